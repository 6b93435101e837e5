"""WebDataset tars made by other tools: written here by the webdataset package's own ShardWriter,
indexed by `distribuuuu data index DIR`, read by the shard reader with its guarantees (every sample
once over ranks, step-exact resume after a SIGTERM, exact evaluation over 2 processes); timm's
_info.json and a wids shard index give the counts; a sample without a label is one line and exit 2
(docs/data-formats.md, "WebDataset tars made elsewhere").
"""

from __future__ import annotations

import collections
import csv
import importlib.util
import json
import os
import sys

import numpy as np
import pytest
import torch
import webdataset

from distribuuuu import api, inference
from distribuuuu.data import shards
from distribuuuu.data.loading.pipeline import Place
from distribuuuu.data.shards import external, tar
from distribuuuu.data.shards.loader import build_shard_loader
from tests.conftest import (
    ROOT,
    TINY,
    check,
    check_user_error,
    cli_main,
    logged,
    make_cfg,
    process_state_restored,
    read_metrics,
    read_text_or_empty,
    run,
    start_until,
    stop_and_wait,
    write_image_tree,
)

NAMES = ("ant", "bee", "cat")


def photo(i: int) -> np.ndarray:
    """16x16 RGB: a colour per class (i mod 3) under noise, so a tiny net learns it in a few steps;
    every 5th image has the next class's colour, so that no model scores 100%."""
    rng = np.random.default_rng(i)
    colour = (i + (i % 5 == 0)) % 3
    base = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200]][colour], np.int16)
    return np.clip(base + rng.integers(-40, 40, (16, 16, 3)), 0, 255).astype(np.uint8)


def write_tars(folder, n: int, maxcount: int, sample=None) -> None:
    """folder/<name>-0000.tar ...: n samples through webdataset.ShardWriter (webdataset encodes the
    arrays: PNG and JPEG by turns; the class index as .cls), or the samples sample(i) makes."""
    os.makedirs(folder, exist_ok=True)
    name = os.path.basename(folder)
    with webdataset.ShardWriter(os.path.join(folder, f"{name}-%04d.tar"), maxcount=maxcount, verbose=0) as sink:
        for i in range(n):
            ext = "png" if i % 2 else "jpg"
            sink.write(sample(i) if sample else {"__key__": f"{name}{i:04d}", ext: photo(i), "cls": i % 3})


@pytest.fixture(scope="module")
def wds_root(tmp_path_factory):
    """DIR/train: 240 samples in tars of 70 (70, 70, 70, 30), DIR/val: 60 in tars of 40, indexed."""
    root = tmp_path_factory.mktemp("wds")
    write_tars(root / "train", 240, 70)
    write_tars(root / "val", 60, 40)
    indexed = check(cli_main("data", "index", str(root)))
    return root, indexed.stdout


def theirs(folder) -> list[list[tuple[str, int]]]:
    """Per tar of the folder, (key, class) of each sample as webdataset reads it."""
    tars = sorted(str(p) for p in folder.glob("*.tar"))
    return [[(s["__key__"], int(s["cls"])) for s in webdataset.WebDataset([t], shardshuffle=False)] for t in tars]


def test_the_index_counts_what_webdataset_reads_and_the_reader_reads_the_same_samples(wds_root):
    root, printed = wds_root
    assert printed.splitlines() == [
        f"indexed 240 samples of 3 classes in 4 tar(s) (counts from the tar headers, labels from cls): "
        f"{root}/train/index.json",
        f"indexed 60 samples of 3 classes in 2 tar(s) (counts from the tar headers, labels from cls): "
        f"{root}/val/index.json"]
    for split in ("train", "val"):
        wds = theirs(root / split)
        index = json.loads((root / split / "index.json").read_text())
        assert [s["num_samples"] for s in index["shards"]] == [len(t) for t in wds]
        assert index["classes"] == ["0", "1", "2"] and index["labels"] == "indices"
        shard_set = shards.load_shard_set(str(root), split, "TRAIN")
        ours = [[(key, shard_set.fields.read(fields)[1]) for key, fields in tar.samples(s.path)]
                for s in shard_set.shards]
        assert ours == wds
    again = (root / "train" / "index.json").read_bytes()
    check(cli_main("data", "index", str(root)))  # its own index is rewritten, the same
    assert (root / "train" / "index.json").read_bytes() == again


def id_sample(i: int, key: str = "label") -> dict:
    """An 8x8 gray PNG holding its id in two pixels, its class name in .json (timm's and LAION's
    layout: the label a key of the sample's JSON)."""
    pixels = np.random.default_rng(i).integers(0, 256, (8, 8), dtype=np.uint8)
    pixels[0, 0], pixels[0, 1] = i // 256, i % 256
    return {"__key__": f"k{i:04d}", "png": pixels, "json": {key: NAMES[i % 3], "width": 8}}


def ids(images: torch.Tensor) -> list[int]:
    pixels = (images[:, 0, 0, :2] * 255).round().long()
    return (pixels[:, 0] * 256 + pixels[:, 1]).tolist()


def id_cfg(root, **extra):
    return make_cfg({"TRAIN.DATASET": str(root), "TEST.DATASET": str(root), "MODEL.IN_CHANS": 1,
                     "MODEL.NUM_CLASSES": 3, "TRAIN.IM_SIZE": 8, "TEST.IM_SIZE": 8, "TRAIN.CROP_SCALE": [1.0, 1.0],
                     "TRAIN.CROP_RATIO": [1.0, 1.0], "TRAIN.FLIP_PROB": 0.0, "TRAIN.INTERPOLATION": "nearest",
                     "TRAIN.MEAN": [0.0], "TRAIN.STD": [1.0], "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 4,
                     "TEST.BATCH_SIZE": 5, "TRAIN.SHARD_SHUFFLE": 8, **extra})


def read_all(cfg, key: str, rank: int, world: int) -> list[tuple[int, int]]:
    loader = build_shard_loader(cfg, key, key == "TRAIN", Place(rank, world, torch.device("cpu")), 3)
    loader.sampler.set_epoch(1)
    return [pair for images, labels in loader for pair in zip(ids(images), labels.tolist())]


def test_json_labels_by_name_every_sample_once_over_ranks_and_the_label_field_checked(tmp_path):
    write_tars(tmp_path / "train", 101, 30, id_sample)
    write_tars(tmp_path / "val", 23, 10, id_sample)
    check_user_error(cli_main("data", "index", str(tmp_path)), "sample 'k0000': no label: no .cls member",
                     "--label-field")
    check(cli_main("data", "index", str(tmp_path), "--label-field", "json:label"))
    index = json.loads((tmp_path / "train" / "index.json").read_text())
    assert index["classes"] == list(NAMES) and index["labels"] == "names"
    cfg = id_cfg(tmp_path)
    for key, n in (("TRAIN", 101), ("TEST", 23)):
        got = [pair for rank in (0, 1) for pair in read_all(cfg, key, rank, 2)]
        assert collections.Counter(got) == collections.Counter((i, i % 3) for i in range(n))
    check_user_error(cli_main("train", "--cfg", TINY, "TRAIN.DATASET", str(tmp_path), "TEST.DATASET",
                              str(tmp_path), "MODEL.NUM_CLASSES", "3", "TRAIN.LABEL_FIELD", "cls",
                              "OUT_DIR", str(tmp_path / "run")),
                     "TRAIN.LABEL_FIELD is 'cls'", "made with the label field 'json:label'")


def test_a_classes_list_beside_the_tars_names_the_classes(tmp_path):
    write_tars(tmp_path / "train", 9, 5)
    (tmp_path / "classes.txt").write_text("ant\nbee\ncat\ndog\n")  # dog: a class without a sample
    check(cli_main("data", "index", str(tmp_path)))
    index = json.loads((tmp_path / "train" / "index.json").read_text())
    assert index["classes"] == ["ant", "bee", "cat", "dog"] and index["labels"] == "indices"
    (tmp_path / "classes.txt").write_text("ant\nbee\n")
    check_user_error(cli_main("data", "index", str(tmp_path)), "sample 'train0002': label '2' is not a class",
                     "classes.txt (2 classes)")


@pytest.mark.parametrize("sample, args, message", [
    ({"__key__": "x9", "png": np.zeros((4, 4), np.uint8)}, [], "sample 'x9': no label: no .cls member (it has .png)"),
    ({"__key__": "x9", "cls": 1}, [], "sample 'x9': no image member (it has .cls)"),
    ({"__key__": "x9", "png": np.zeros((4, 4), np.uint8), "json": {"size": 4}}, ["--label-field", "json:label"],
     "sample 'x9': no label: its .json has no key 'label' (size)"),
    ({"__key__": "x9", "png": np.zeros((4, 4), np.uint8), "cls": -1}, [], "sample 'x9': label -1 is no class"),
])
def test_a_sample_without_a_label_or_image_is_one_line_naming_the_tar_and_the_key(tmp_path, sample, args, message):
    def samples(i):
        if i == 3:
            return sample
        return {"__key__": f"x{i}", "png": np.zeros((4, 4), np.uint8), "cls": 0, "json": {"label": "a"}}

    write_tars(tmp_path / "train", 5, 5, samples)
    line = check_user_error(cli_main("data", "index", str(tmp_path), *args), message)
    assert f"shard {tmp_path}/train/train-0000.tar" in line
    assert not (tmp_path / "train" / "index.json").exists()


def test_timm_info_json_gives_the_splits_and_counts(tmp_path):
    """timm's layout: the tars flat in DIR, _info.json as rwightman/imagenet-12k's wds/build_wds.py writes it."""
    for split, n in (("train", 50), ("validation", 12)):
        write_tars(tmp_path / "tmp", n, 20, lambda i, s=split: {"__key__": f"{s}{i}", "jpg": photo(i), "cls": i % 3})
        for k, t in enumerate(sorted((tmp_path / "tmp").glob("*.tar"))):
            t.rename(tmp_path / f"in1k-{split}-{k:04d}.tar")
    tars = {s: sorted(p.name for p in tmp_path.glob(f"in1k-{s}-*.tar")) for s in ("train", "validation")}
    lengths = {"train": [20, 20, 10], "validation": [12]}
    info = {"name": "in1k", "splits": {
        s: {"name": s, "filenames": tars[s], "shard_lengths": lengths[s], "alt_label": None,
            "num_samples": sum(lengths[s])} for s in tars}}
    info["splits"]["train_12k"] = {**info["splits"]["train"], "alt_label": "label_12k", "shard_lengths": [1, 1, 1]}
    (tmp_path / "_info.json").write_text(json.dumps(info))
    printed = check(cli_main("data", "index", str(tmp_path))).stdout
    assert "indexed 50 samples of 3 classes in 3 tar(s) (counts from _info.json" in printed
    assert "indexed 12 samples of 3 classes in 1 tar(s)" in printed and "train_12k" not in printed
    for split, key, n in (("train", "TRAIN", 50), ("val", "TEST", 12)):  # timm's validation is our val
        shard_set = shards.load_shard_set(str(tmp_path), split, key)
        assert [os.path.basename(s.path) for s in shard_set.shards] == tars["validation" if split == "val" else split]
        assert sum(1 for s in shard_set.shards for _ in tar.samples(s.path)) == n == shard_set.num_samples
    info["splits"]["train"]["shard_lengths"] = [20, 19, 10]
    (tmp_path / "_info.json").write_text(json.dumps(info))
    check_user_error(cli_main("data", "index", str(tmp_path)),
                     f"{tmp_path}/{tars['train'][1]} holds 20 samples, but _info.json records 19")
    # With the class names given too, nothing is read but one sample: the counts are timm's as they are
    info["splits"]["train"]["shard_lengths"] = [20, 20, 10]
    (tmp_path / "_info.json").write_text(json.dumps(info))
    (tmp_path / "classes.txt").write_text("ant\nbee\ncat\n")
    last = tmp_path / tars["train"][2]
    last.write_bytes(bytes(last.stat().st_size))  # no tar any more: a read would fail
    check(cli_main("data", "index", str(tmp_path)))
    assert shards.load_shard_set(str(tmp_path), "train", "TRAIN").classes == ["ant", "bee", "cat"]


def test_a_wids_shard_index_gives_the_tars_and_their_counts(tmp_path):
    """The wids shard index as webdataset's `widsindex create` writes it (wids/wids_index.py)."""
    write_tars(tmp_path / "train", 45, 20)
    tars = sorted((tmp_path / "train").glob("*.tar"))
    listed = [{"url": t.name, "nsamples": n, "filesize": t.stat().st_size, "md5sum": "-"}
              for t, n in zip(tars[:2], (20, 20))]  # the last tar is not listed: not read
    desc = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": listed, "name": "train"}
    (tmp_path / "train" / "shardindex.json").write_text(json.dumps(desc))
    printed = check(cli_main("data", "index", str(tmp_path))).stdout
    assert "indexed 40 samples of 3 classes in 2 tar(s) (counts from shardindex.json" in printed
    assert shards.load_shard_set(str(tmp_path), "train", "TRAIN").num_samples == 40
    listed[1]["filesize"] += 1
    (tmp_path / "train" / "shardindex.json").write_text(json.dumps(desc))
    check_user_error(cli_main("data", "index", str(tmp_path)), f"{tars[1]} is", "shardindex.json records",
                     "the tar changed since")


def test_tars_grouped_by_class_get_a_note_and_shuffled_ones_none(tmp_path):
    write_tars(tmp_path / "sorted" / "train", 60, 20, lambda i: {"__key__": f"s{i}", "png": photo(i), "cls": i // 20})
    write_tars(tmp_path / "mixed" / "train", 60, 20)
    note = check(cli_main("data", "index", str(tmp_path / "sorted"))).stdout.splitlines()[1]
    assert note.startswith("note: the train tars hold their samples grouped by class (") and "holds 1 of 3" in note
    assert len(check(cli_main("data", "index", str(tmp_path / "mixed"))).stdout.splitlines()) == 1


def test_the_recipe_follows_a_sample_of_the_tars_images(wds_root):
    """As for a folder: the keys a config leaves unset are decided from the images (16 px RGB)."""
    root, _ = wds_root
    cfg = make_cfg({"TRAIN.DATASET": str(root)})
    assert (cfg.MODEL.ARCH, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE, cfg.TRAIN.FLIP_PROB) == ("resnet_tiny", 3, 32, 0.5)
    # their own mean: each channel is 200 in a third of the images and 40 in the rest (noise averages out)
    assert list(cfg.TRAIN.CROP_SCALE) == [0.8, 1.0] and cfg.TRAIN.MEAN == pytest.approx([280 / 3 / 255] * 3, abs=0.03)


def test_bench_io_times_tars_of_the_same_images_beside_the_folder(tmp_path):
    """`bench --io --io-tars`: the tars that benchmarks/io_tars.py writes with webdataset, indexed."""
    spec = importlib.util.spec_from_file_location("io_tars", os.path.join(ROOT, "benchmarks", "io_tars.py"))
    io_tars = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(io_tars)
    write_image_tree(str(tmp_path / "jpegs"), "train", {"a": 12, "b": 12}, ext="jpg", size=(16, 16))
    assert io_tars.write_tars(str(tmp_path / "jpegs"), str(tmp_path / "tars"), maxcount=10) == 24
    external.index_tars(str(tmp_path / "tars"), label_field="json:label", progress=False)
    def bench(folder):
        return cli_main("bench", "--io", "--io-tars", str(tmp_path / "tars"), "--workers", "0", "--iters", "2",
                        "--warmup", "0", "--repeats", "1", "--out", str(tmp_path / "bench"), "TRAIN.DATASET",
                        str(tmp_path / folder), "TRAIN.BATCH_SIZE", "4", "TRAIN.IM_SIZE", "16", "DEVICE", "cpu")

    proc = check(bench("jpegs"))
    with open(tmp_path / "bench" / "io.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["format"], r["dataset_images"]) for r in rows] == [("folder", "24"), ("shards", "24"), ("tars", "24")]
    assert "tars / folder, img/CPU-s: 0 workers " in proc.stdout
    write_image_tree(str(tmp_path / "more"), "train", {"a": 13, "b": 12}, ext="jpg", size=(16, 16))
    check_user_error(bench("more"), "holds 24 images in split 'train', but the folder has 25")
    assert [e for e in os.listdir(tmp_path / "bench") if e.startswith("io_shards.")] == []  # none written


def test_what_is_not_a_folder_of_tars_is_one_line(tmp_path):
    check_user_error(cli_main("data", "index", str(tmp_path / "nope")), "is not a folder of tars")
    (tmp_path / "a.tar.gz").write_bytes(b"")
    check_user_error(cli_main("data", "index", str(tmp_path)), "no .tar files in", "a.tar.gz is compressed")
    (tmp_path / "index.json").write_text(json.dumps({"version": 2, "shards": []}))  # another tool's
    write_tars(tmp_path / "flat", 3, 5)
    for t in (tmp_path / "flat").glob("*.tar"):
        t.rename(tmp_path / t.name)
    os.rmdir(tmp_path / "flat")
    check_user_error(cli_main("data", "index", str(tmp_path)), "index.json exists and is not a distribuuuu")


# ---------------------------------------------------------------------------------------------
# Done when: 2 processes train on DIR, a SIGTERM mid-epoch and the same command give the straight
# run's metrics rows; evaluation on 2 processes counts as on 1
# ---------------------------------------------------------------------------------------------
MEASURED = ("img_per_s", "time_s", "data_frac", "peak_mem_mb")  # how fast, not what was learnt
EXACT = ("top1", "topk_acc", "n", "per_class_top1")  # counts, equal on any number of processes


def _numbers(out) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in MEASURED} for row in read_metrics(str(out))]


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.e2e
def test_two_processes_train_stop_on_sigterm_resume_and_evaluate_exactly(wds_root, tmp_path):
    root, _ = wds_root
    train = [sys.executable, "-m", "distribuuuu", "train", "--nproc-per-node", "2", "--cfg", TINY,
             "TRAIN.DATASET", str(root), "TEST.DATASET", "", "MODEL.NUM_CLASSES", "0", "TRAIN.BATCH_SIZE", "4",
             "TRAIN.PRINT_FREQ", "2", "OPTIM.MAX_EPOCH", "2"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check(run([*train, "OUT_DIR", str(straight)], timeout=300))
    stop_and_wait(*start_until([*train, "OUT_DIR", str(stopped)], stopped, logged("[train] epoch 1/2 iter")))
    ckpt = torch.load(stopped / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0 and 0 < ckpt["samples_in_epoch"] < 240, ckpt["samples_in_epoch"]
    check(run([*train, "OUT_DIR", str(stopped)], timeout=300))
    assert f"{ckpt['samples_in_epoch']} samples into epoch 1" in read_text_or_empty(stopped / "log.txt")
    assert _numbers(stopped) == _numbers(straight)
    assert [(r["epoch"], r["split"], r["n"]) for r in _numbers(straight)] == [
        (1, "train", 240), (1, "val", 60), (2, "train", 240), (2, "val", 60)]
    # Evaluation from the checkpoint alone (its config names the tars), of epoch 1 (top-1 neither 0
    # nor 100): 2 processes (`distribuuuu eval` and the run's own val row) count as 1 (in this process)
    weights = str(straight / "checkpoints" / "epoch_0001.pth")
    check(run([sys.executable, "-m", "distribuuuu", "eval", "--checkpoint", weights, "--nproc-per-node", "2"]))
    with process_state_restored():
        one = api.evaluate(inference.load_config(None, ["MODEL.WEIGHTS", weights]))
    two, during = read_jsonl(straight / "eval.jsonl")[0], read_metrics(str(straight))[1]
    assert 0 < one["top1"] < 100 and one["n"] == 60
    for other in (two, during):
        assert [other[k] for k in EXACT] == [one[k] for k in EXACT]
        assert other["loss"] == pytest.approx(one["loss"], rel=1e-6)
