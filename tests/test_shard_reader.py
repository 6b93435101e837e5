"""Training and evaluating from shards: the epoch plan, the tar reader, every sample once across ranks x
workers, step-exact resume, exact evaluation, bad records, truncated shards and shards off their index
count (docs/data-at-scale.md).

The images carry their id in two pixels, and the loaders run with a crop of the whole image, no
flip, nearest interpolation, mean 0 and std 1, so every batch can be read back as sample ids.
"""

from __future__ import annotations

import collections
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from distribuuuu import api, data, model_card
from distribuuuu.data import shards, transforms
from distribuuuu.data.loading.items import UnreadableImage
from distribuuuu.data.loading.pipeline import Place
from distribuuuu.data.shards import plan, tar
from distribuuuu.data.shards.loader import build_shard_loader
from tests.conftest import (
    ROOT,
    TINY,
    check,
    cli_main,
    env,
    make_cfg,
    process_state_restored,
    read_metrics,
)

CLASSES = ("a", "b", "c")


def write_id_images(root, split: str, n: int) -> None:
    """root/split/<class>/<id>.png, 8x8 gray; pixels (0,0), (0,1) hold the id; class = id mod 3."""
    rng = np.random.default_rng(len(split))
    for i in range(n):
        pixels = rng.integers(0, 256, (8, 8), dtype=np.uint8)
        pixels[0, 0], pixels[0, 1] = i // 256, i % 256
        path = os.path.join(root, split, CLASSES[i % 3], f"{i:04d}.png")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.fromarray(pixels).save(path)


@pytest.fixture(scope="module")
def id_shards(tmp_path_factory):
    """101 train samples in 12 shards of <= 9 (not a multiple of ranks x workers), 37 val in 5."""
    root = tmp_path_factory.mktemp("ids")
    write_id_images(root / "src", "train", 101)
    write_id_images(root / "src", "val", 37)
    shards.write_shards(str(root / "src"), str(root / "sh"), shard_samples=9, progress=False)
    return str(root / "sh")


def id_opts(dataset: str, workers: int = 2, batch: int = 4, **extra) -> dict:
    opts = {"TRAIN.DATASET": dataset, "TEST.DATASET": dataset, "TEST.SPLIT": "val", "MODEL.IN_CHANS": 1,
            "MODEL.NUM_CLASSES": 3, "TRAIN.IM_SIZE": 8, "TEST.IM_SIZE": 8, "TRAIN.CROP_SCALE": [1.0, 1.0],
            "TRAIN.CROP_RATIO": [1.0, 1.0], "TRAIN.FLIP_PROB": 0.0, "TRAIN.INTERPOLATION": "nearest",
            "TRAIN.MEAN": [0.0], "TRAIN.STD": [1.0], "TRAIN.WORKERS": workers, "TRAIN.BATCH_SIZE": batch,
            "TEST.BATCH_SIZE": 5, "TRAIN.SHARD_SHUFFLE": 16, "RNG_SEED": 3, "TRAIN.TOPK": 2}
    return {**opts, **extra}


def _argv(opts: dict) -> list[str]:
    """{KEY: value} as KEY VALUE command-line words."""
    return [v if isinstance(v, str) else repr(v) for kv in opts.items() for v in kv]


def ids(images: torch.Tensor) -> list[int]:
    pixels = (images[:, 0, 0, :2] * 255).round().long()
    return (pixels[:, 0] * 256 + pixels[:, 1]).tolist()


def torch_loader(loader):
    while not hasattr(loader, "_iterator"):  # ShardLoader -> ... -> torch's DataLoader
        loader = loader.loader
    return loader


def stop_workers(loader) -> None:
    """Stop a shard loader's persistent workers now (a loader that ran without error keeps them)."""
    loader = torch_loader(loader)
    if loader._iterator is not None:
        loader._iterator._shutdown_workers()


def epoch_ids(cfg, rank: int, world: int, epoch: int, start: int = 0, train: bool = True) -> list[list[int]]:
    loader = build_shard_loader(cfg, "TRAIN" if train else "TEST", train, Place(rank, world, torch.device("cpu")), 3)
    loader.sampler.set_epoch(epoch, start)
    try:
        return [ids(images) for images, _ in loader]
    finally:
        stop_workers(loader)


# -- the plan ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [7, 33, 101, 256])
def test_the_plan_covers_every_sample_once_in_equal_steps(n):
    for world in (1, 2, 3, 4):
        for batch, accum, workers in ((1, 1, 0), (3, 1, 2), (8, 2, 3), (5, 1, 1)):
            if n < batch * world * accum:
                continue
            if plan.smallest_train_batch(n, world, batch, accum) < 1:  # refused by check_datasets
                assert batch == 1 and n % world or accum > 1, (n, world, batch, accum)
                continue
            seen, steps = [], set()
            for rank in range(world):
                begin, sizes = plan.rank_batches(n, world, rank, batch, accum, train=True)
                steps.add(len(sizes))
                assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1 and max(sizes) <= batch
                parts = plan.worker_plans(begin, sizes, workers)
                # worker w makes batches w, w+K, ...: together, in round-robin order, every batch once
                assert sorted(j for p in parts for j, _ in p.batches) == list(range(len(sizes)))
                for p in parts:
                    assert [j for j, _ in p.batches] == list(range(parts.index(p), len(sizes), len(parts)))
                    seen += range(p.begin, p.begin + p.num_samples)
            assert sorted(seen) == list(range(n)), (n, world, batch, accum, workers)
            assert len(steps) == 1 and steps.pop() % accum == 0  # equal steps, whole optimizer steps


def test_evaluation_batches_cover_each_rank_range_and_may_differ_between_ranks():
    # ranges of 2, 3, 2, 3 samples; TEST.BATCH_SIZE 2
    assert [plan.rank_batches(10, 4, r, 2, 1, train=False)[1] for r in range(4)] == [[2], [2, 1], [2], [2, 1]]
    assert plan.rank_batches(1, 3, 0, 4, 1, train=False) == (0, [])  # a rank may get nothing


def test_locate_and_the_epoch_orders():
    counts = np.array([3, 0, 5, 2])
    assert [plan.locate(counts, p) for p in (0, 2, 3, 7, 8, 9)] == [(0, 0), (0, 2), (2, 0), (2, 4), (3, 0), (3, 1)]
    assert list(plan.shard_order(5, 1, 0)) != list(plan.shard_order(5, 1, 1))  # another order per epoch
    assert list(plan.shard_order(5, 1, 2)) == list(plan.shard_order(5, 1, 2))
    assert list(plan.block_order(0, 0, 40, 6, shuffle=False)) == list(range(6))


# -- the tar reader --------------------------------------------------------------------------------
def _tar(path, names, fmt):
    with tarfile.open(path, "w", format=fmt) as t:
        for name in names:
            info = tarfile.TarInfo(name)
            body = name.encode() * 3
            info.size = len(body)
            t.addfile(info, io.BytesIO(body))


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_reader_reads_what_tarfile_reads_and_skips_by_seeking(tmp_path, fmt):
    folder = "d" * 120 if fmt != tarfile.USTAR_FORMAT else "dir"  # long names: GNU 'L' / pax 'x' headers
    names = [f"{folder}/s{i}.{ext}" for i in range(5) for ext in ("jpg", "cls")]
    path = str(tmp_path / "t.tar")
    _tar(path, names, fmt)
    got = list(tar.samples(path))
    assert [k for k, _ in got] == [f"{folder}/s{i}" for i in range(5)]
    assert got[2][1] == {"jpg": f"{folder}/s2.jpg".encode() * 3, "cls": f"{folder}/s2.cls".encode() * 3}
    for skip in range(6):
        assert list(tar.samples(path, skip=skip)) == got[skip:]


def test_a_truncated_or_damaged_shard_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "t.tar")
    _tar(path, [f"s{i}.{e}" for i in range(20) for e in ("jpg", "cls")], tarfile.USTAR_FORMAT)
    whole = open(path, "rb").read()
    for cut in (700, 512 * 10, 512 * 40 + 100):  # inside a member, between members, inside a header
        open(path, "wb").write(whole[:cut])
        for skip in (0, 3):
            with pytest.raises(tar.ShardError, match=f"shard {path} .*truncated"):
                list(tar.samples(path, skip=skip))
    damaged = bytearray(whole)
    damaged[1024 + 3] ^= 0xFF  # a name byte of the second header: its checksum no longer matches
    open(path, "wb").write(bytes(damaged))
    with pytest.raises(tar.ShardError, match="wrong checksum at byte 1024"):
        list(tar.samples(path))


# -- exactly once, resume, exact evaluation ----------------------------------------------------------
def test_two_ranks_of_two_workers_read_every_sample_once_per_epoch_in_new_orders(id_shards):
    cfg = make_cfg(id_opts(id_shards))
    epochs = []
    for epoch in (0, 1):
        per_rank = [epoch_ids(cfg, rank, 2, epoch) for rank in (0, 1)]
        assert len(per_rank[0]) == len(per_rank[1]) == 13  # ceil(51 / 4): equal steps on both ranks
        flat = [i for rank in per_rank for batch in rank for i in batch]
        assert collections.Counter(flat) == collections.Counter(range(101))  # each once, none dropped
        epochs.append(flat)
    assert epochs[0] != epochs[1]
    # One loader for both epochs, as training keeps it: its persistent workers read the new epoch.
    loader = build_shard_loader(cfg, "TRAIN", True, Place(0, 2, torch.device("cpu")), 3)
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        assert [ids(images) for images, _ in loader] == epoch_ids(cfg, 0, 2, epoch)
    index = json.load(open(os.path.join(id_shards, "train", "index.json")))
    # More than shard order: a batch mixes samples of different shards, and no shard is read in its order.
    in_order = [k for s in index["shards"] for k, _ in tar.samples(os.path.join(id_shards, "train", s["name"]))]
    assert epochs[0][:9] != [int(k) for k in in_order[:9]]


def test_a_resumed_epoch_yields_the_same_remaining_batches_bit_for_bit(id_shards):
    opts = id_opts(id_shards)
    opts.update({"TRAIN.CROP_SCALE": [0.3, 1.0], "TRAIN.FLIP_PROB": 0.5, "TRAIN.INTERPOLATION": "bilinear"})
    cfg = make_cfg(opts)  # random crops and flips: the same only if each batch has its own seed
    loader = build_shard_loader(cfg, "TRAIN", True, Place(1, 2, torch.device("cpu")), 3)
    loader.sampler.set_epoch(1)
    straight = [images for images, _ in loader]
    loader.sampler.set_epoch(1, start=5 * 4 * 2)  # 5 steps of 4 x 2 ranks done
    assert len(loader) == len(straight) - 5
    resumed = [images for images, _ in loader]
    assert len(resumed) == len(straight) - 5
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight[5:]))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_evaluation_counts_every_val_sample_once(id_shards, world):
    cfg = make_cfg(id_opts(id_shards, workers=2))
    got = [i for rank in range(world) for batch in epoch_ids(cfg, rank, world, 0, train=False) for i in batch]
    assert sorted(got) == list(range(37))


def _id_of(png: bytes) -> int:
    pixels = np.array(Image.open(io.BytesIO(png)))
    return int(pixels[0, 0]) * 256 + int(pixels[0, 1])


def _corrupt_record(folder: str, sample_id: int) -> str:
    """Rewrite the shard holding image `sample_id` with that image's bytes replaced by non-image
    bytes (its index updated to the new size); returns the record's key."""
    index = json.load(open(os.path.join(folder, "index.json")))
    for s in index["shards"]:
        path = os.path.join(folder, s["name"])
        with tarfile.open(path) as t:
            members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
        hit = [m.name for m, body in members if m.name.endswith(".png") and _id_of(body) == sample_id]
        if not hit:
            continue
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
            for m, body in members:
                if m.name == hit[0]:
                    body = b"not a png" * (len(body) // 9)
                    m.size = len(body)
                t.addfile(m, io.BytesIO(body))
        s["bytes"] = os.path.getsize(path)
        json.dump(index, open(os.path.join(folder, "index.json"), "w"))
        return hit[0].split(".")[0]
    raise AssertionError(f"no image {sample_id}")


def test_a_bad_record_is_replaced_in_training_left_out_in_evaluation_and_counted(tmp_path):
    write_id_images(tmp_path / "src", "train", 24)
    write_id_images(tmp_path / "src", "val", 10)
    shards.write_shards(str(tmp_path / "src"), str(tmp_path / "sh"), shard_samples=5, progress=False)
    key = _corrupt_record(str(tmp_path / "sh" / "train"), 7)
    _corrupt_record(str(tmp_path / "sh" / "val"), 3)
    cfg = make_cfg(id_opts(str(tmp_path / "sh"), workers=2))
    train = build_shard_loader(cfg, "TRAIN", True, Place(0, 1, torch.device("cpu")), 3)
    train.sampler.set_epoch(0)
    batches = [ids(images) for images, _ in train]
    assert [len(b) for b in batches] == [4] * 6  # every batch keeps its size
    flat = [i for b in batches for i in b]
    assert set(flat) == set(range(24)) - {7} and len(flat) == 24  # one readable sample stands in
    assert len(data.take_unreadable(train)) == 1
    val = build_shard_loader(cfg, "TEST", False, Place(0, 1, torch.device("cpu")), 0)
    assert sorted(i for images, _ in val for i in ids(images)) == [i for i in range(10) if i != 3]
    assert len(data.take_unreadable(val)) == 1
    strict = make_cfg(id_opts(str(tmp_path / "sh"), workers=2, **{"TRAIN.BAD_IMAGES": "fail"}))
    strict_loader = build_shard_loader(strict, "TRAIN", True, Place(0, 1, torch.device("cpu")), 3)
    with pytest.raises(UnreadableImage, match=rf"^cannot decode record '{key}' of .*index.json \("):
        list(strict_loader)
    # Its persistent workers are stopped with the error: left to the garbage collector, which frees the
    # failed loader late (a reference cycle), torch's shutdown would wait out its join timeouts (~20 s).
    assert torch_loader(strict_loader)._iterator is None
    stop_workers(train)


def test_a_shard_truncated_while_training_is_one_clear_error_from_a_worker(tmp_path):
    write_id_images(tmp_path / "src", "train", 30)
    shards.write_shards(str(tmp_path / "src" / "train"), str(tmp_path / "sh"), shard_samples=10, progress=False)
    cfg = make_cfg(id_opts(str(tmp_path / "sh"), workers=2))
    loader = build_shard_loader(cfg, "TRAIN", True, Place(0, 1, torch.device("cpu")), 3)  # checked complete here
    victim = os.path.join(tmp_path, "sh", "train", "train-000001.tar")
    os.truncate(victim, os.path.getsize(victim) // 2)
    loader.sampler.set_epoch(0)
    with pytest.raises(tar.ShardError) as caught:
        list(loader)
    assert torch_loader(loader)._iterator is None  # the workers are stopped with the error
    message = str(caught.value)
    assert message.startswith(f"shard {victim} ") and "truncated" in message and "Traceback" not in message


# A shard that holds more or fewer samples than its index.json records: an error naming the shard, read
# by the main process or by loader workers; never a hang, never a quietly shorter epoch (before: an index
# that under-counts the last shard trained on fewer samples, exit 0).
def _shards_with_count(tmp_path, delta: int) -> tuple[str, str]:
    """24 train samples in shards of 5; the index of the shard read last in epoch 0 is off by delta."""
    write_id_images(tmp_path / "src", "train", 24)
    write_id_images(tmp_path / "src", "val", 6)
    root = str(tmp_path / "sh")
    shards.write_shards(str(tmp_path / "src"), root, shard_samples=5, progress=False)
    folder = os.path.join(root, "train")
    with open(os.path.join(folder, "index.json")) as f:
        index = json.load(f)
    order = shards.plan.shard_order(len(index["shards"]), 3, 0)  # the seed the loader is given (epoch_ids)
    victim = index["shards"][int(order[-1])]
    victim["num_samples"] += delta
    with open(os.path.join(folder, "index.json"), "w") as f:
        json.dump(index, f)
    return root, os.path.join(folder, victim["name"])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("delta", [-1, 1], ids=["index-under-counts", "index-over-counts"])
def test_a_shard_off_its_index_count_is_an_error_naming_it(tmp_path, workers, delta):
    root, victim = _shards_with_count(tmp_path, delta)
    cfg = make_cfg(id_opts(root, workers=workers, batch=4))
    with pytest.raises(tar.ShardError, match=rf"shard {victim} holds \d+ samples, but its index .* records"):
        epoch_ids(cfg, 0, 1, 0)


def test_the_model_card_of_a_shard_run_has_the_image_file_preprocessing(id_shards):
    opts = {k: v for k, v in id_opts(id_shards, workers=0).items() if k not in ("TRAIN.MEAN", "TRAIN.STD")}
    cfg = make_cfg({**opts, "TEST.IM_SIZE": 10})
    card = model_card.describe(cfg, build_shard_loader(cfg, "TRAIN", True, Place(0, 1, torch.device("cpu")), 3).dataset)
    stats = transforms.image_stats(cfg)  # what the loader normalizes with: the images' own, as for a folder
    assert (card.mean, card.std) == (list(stats[0]), list(stats[1])) and card.resize == 10
    assert stats != transforms.stats_for_channels(transforms.IMAGENET_STATS, 1)
    assert card.classes == list(CLASSES)


# -- the command ------------------------------------------------------------------------------------
def test_train_on_shards_in_process_counts_every_sample_and_refuses_what_cannot_work(id_shards, tmp_path):
    opts = _argv(id_opts(id_shards, workers=0))
    cfg = make_cfg(*opts, "OUT_DIR", str(tmp_path / "run"), "OPTIM.MAX_EPOCH", "1", base=TINY)
    with process_state_restored():
        api.train(cfg)
    records = read_metrics(str(tmp_path / "run"))
    assert [(r["split"], r["n"]) for r in records] == [("train", 101), ("val", 37)]
    for extra, expected in ((["TRAIN.VAL_SPLIT", "0.1"], "TRAIN.VAL_SPLIT holds out random samples"),
                            (["TRAIN.DATA_PIPELINE", "memory"], "is a shard set; use TRAIN.DATA_PIPELINE auto")):
        proc = cli_main("train", "--cfg", TINY, *opts, *extra, "OUT_DIR", str(tmp_path / "refused"))
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    victim = os.path.join(id_shards, "val", "val-000002.tar")
    whole = open(victim, "rb").read()
    try:
        open(victim, "wb").write(whole[:1000])
        proc = cli_main("train", "--cfg", TINY, *opts, "OUT_DIR", str(tmp_path / "truncated"))
        assert proc.returncode == 2 and f"shard {victim} is 1000 bytes but its index records" in proc.stderr
    finally:
        open(victim, "wb").write(whole)


# -- real processes ----------------------------------------------------------------------------------
@pytest.mark.e2e
def test_two_torchrun_processes_of_two_workers_read_every_key_once(id_shards, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "tests/scripts/shard_keys.py", str(tmp_path), *_argv(id_opts(id_shards, workers=2))]
    check(subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240))
    ranks = [json.load(open(tmp_path / f"ids.rank{r}.json")) for r in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 13
    for epoch in (0, 1):
        assert [len(r["train"][epoch]) for r in ranks] == [13, 13]
        keys = [i for r in ranks for batch in r["train"][epoch] for i in batch]
        assert collections.Counter(keys) == collections.Counter(range(101))
    assert ranks[0]["train"][0] != ranks[0]["train"][1]  # the persistent workers saw the new epoch
    assert sorted(ranks[0]["val"] + ranks[1]["val"]) == list(range(37))


@pytest.mark.e2e
def test_step_exact_resume_on_shards_with_two_ranks(id_shards, tmp_path):
    """As test_faults' folder test: stopped by a signal after step 4 of 13, resumed, the same losses."""
    base = ["--cfg", TINY, *_argv(id_opts(id_shards, workers=2)), "OPTIM.MAX_EPOCH", "2", "TRAIN.PRINT_FREQ", "1"]
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")

    def run(out, extra_env=None, *extra):
        e = {**env(), "LOSS_LOG": f"{out}/loss", **(extra_env or {})}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "tests/scripts/fault_run.py", *base, "OUT_DIR", out, *extra]
        return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=240)

    check(run(straight))
    assert run(stopped, {"SIGNAL_AT": "4:1:SIGUSR1"}).returncode != 0
    refused = run(stopped, None, "TRAIN.WORKERS", "1")
    assert refused.returncode != 0 and "workers 2 -> 1" in refused.stdout + refused.stderr
    check(run(stopped))
    for rank in (0, 1):
        losses = [open(f"{out}/loss.rank{rank}").read().split() for out in (straight, stopped)]
        assert losses[0] == losses[1] and len(losses[0]) == 26
    pick = lambda out, split: [(m["n"], m["loss"]) for m in read_metrics(out) if m["split"] == split]  # noqa: E731
    assert pick(stopped, "train") == pick(straight, "train") and [n for n, _ in pick(stopped, "train")] == [101, 101]
    assert [n for n, _ in pick(stopped, "val")] == [37, 37]
