"""TRAIN.IMAGE_DECODE gpu and auto (distribuuuu/data/device.py), run on the CPU: the workers draw the
fast path's crops and flips and return the encoded JPEGs, the main process decodes them with
torchvision.io.decode_jpeg(list, device="cpu"), the same call as on a GPU but for the device. What only a
GPU runs (nvJPEG, the side stream) is listed in docs/performance.md, section 6b."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torchvision.io as tio
from PIL import Image

from distribuuuu import data
from distribuuuu.data import loading, shards, transforms
from distribuuuu.data.decoding import cpu, device
from distribuuuu.data.decoding.device import DecodedBatches, DeviceDecode, DeviceDecodePipeline
from distribuuuu.data.loading import items
from distribuuuu.data.loading import pipeline as lpipeline
from distribuuuu.data.loading.batches import NormalizedBatches
from distribuuuu.errors import UserError
from tests.conftest import ROOT, TINY, check, env, make_cfg

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: bitwise-repeatable arithmetic


@pytest.fixture(autouse=True)
def _end_workers():
    """The loaders' persistent workers end with each test, not at the interpreter's exit."""
    yield
    data.stop_workers()

CPU = torch.device("cpu")
# The device path resizes float pixels where the fast path resizes uint8 and rounds: measured on smooth
# images (test_the_device_half_is_the_fast_paths_geometry_within_its_rounding), in 0-255 units.
BOUND = {"bilinear": 1.0, "bicubic": 1.25, "nearest": 0.0}
MEAN_BOUND = 0.35
KINDS = ("baseline", "gray", "progressive", "cmyk", "png")  # the last three: decoded in the worker
REFUSED = ("progressive", "cmyk", "png")


def smooth(width: int, height: int, seed: int) -> np.ndarray:
    """An RGB image with structure and mild noise, without the 0/255 cliffs where bicubic's uint8 and
    float kernels part (the uint8 one saturates between its two passes)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    wave = 127 + 100 * np.sin(xx / 7.0 + seed)[..., None] * np.cos(yy / (5.0 + seed % 3))[..., None]
    return np.clip(wave + rng.integers(-16, 16, (height, width, 3)), 0, 255).astype(np.uint8)


def encoded(kind: str, seed: int, size: tuple[int, int] = (80, 60)) -> bytes:
    image, out = Image.fromarray(smooth(*size, seed)), io.BytesIO()
    if kind == "png":
        image.save(out, "PNG")
    else:
        image = {"gray": image.convert("L"), "cmyk": image.convert("CMYK")}.get(kind, image)
        image.save(out, "JPEG", quality=90, progressive=kind == "progressive")
    return out.getvalue()


def undecodable_jpeg() -> bytes:
    """A JPEG whose headers and end marker are whole (so the worker passes it on) but whose scan names
    Huffman tables that do not exist: libjpeg-turbo and PIL both refuse it."""
    out = io.BytesIO()
    Image.fromarray(smooth(80, 60, 0)).save(out, "JPEG")
    raw = bytearray(out.getvalue())
    sos = raw.index(b"\xff\xda")
    for k in range(raw[sos + 4]):
        raw[sos + 6 + 2 * k] = 0x33
    return bytes(raw)


def write_folder(root: str, per_class: int = 10, extra: dict[str, bytes] | None = None) -> None:
    """root/train/{a,b}/: every KINDS in turn, landscape and portrait; crops never reach twice the output
    size of the tests (32 px), so the fast path decodes at full scale, as the device does."""
    for c, name in enumerate(("a", "b")):
        os.makedirs(os.path.join(root, "train", name), exist_ok=True)
        for i in range(per_class):
            kind = KINDS[i % len(KINDS)]
            size = (80, 60) if i % 2 else (60, 80)
            with open(os.path.join(root, "train", name, f"{i:02d}.{'png' if kind == 'png' else 'jpg'}"), "wb") as f:
                f.write(encoded(kind, 10 * c + i, size))
    for name, raw in (extra or {}).items():
        with open(os.path.join(root, "train", "a", name), "wb") as f:
            f.write(raw)


def opts(root: str, decode: str, **extra) -> dict:
    return {"TRAIN.DATASET": root, "TEST.DATASET": root, "TEST.SPLIT": "train", "MODEL.NUM_CLASSES": 2,
            "TRAIN.TOPK": 1, "TRAIN.IM_SIZE": 32, "TEST.IM_SIZE": 36, "TRAIN.BATCH_SIZE": 4, "TEST.BATCH_SIZE": 6,
            "TRAIN.WORKERS": 2, "RNG_SEED": 1, "TRAIN.IMAGE_DECODE": decode, **extra}


def pixels(images_: torch.Tensor, cfg) -> torch.Tensor:
    """Normalized batches back in 0-255."""
    mean, std = (torch.tensor(s).view(1, -1, 1, 1) for s in transforms.image_stats(cfg))
    return (images_ * std + mean) * 255


def epoch(cfg, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = data.build_train_loader(cfg, 0, 1, CPU)
    loader.sampler.set_epoch(1, start)
    return [(x, y) for x, y in loader]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("jpegs"))
    write_folder(root)
    return root


@pytest.fixture(scope="module")
def shard_set(folder, tmp_path_factory) -> str:
    dest = str(tmp_path_factory.mktemp("shards") / "sh")
    shards.write_shards(folder, dest, shard_samples=7, progress=False)
    return dest


def test_the_worker_passes_on_what_the_device_decodes_and_finishes_the_rest_itself():
    fast = cpu.FastTrainDecode(32, "RGB")
    for kind in KINDS:
        data_, box = DeviceDecode(fast)(encoded(kind, 1))
        assert box.shape == (5,)
        if kind in REFUSED:  # the fast path's own crop, made in the worker
            assert data_.shape == (3, 32, 32) and data_.dtype == torch.uint8 and not box.any(), kind
        else:
            assert data_.dim() == 1 and bytes(data_.numpy()) == encoded(kind, 1), kind
            top, left, h, w, flip = box.tolist()
            assert 0 <= top < top + h <= 60 and 0 <= left < left + w <= 80 and flip in (0, 1)
    cut = encoded("baseline", 1)[:-200]  # truncated: no end marker, the fast path's (and its bad-image handling)
    assert device.device_size(cut) is None and device.device_size(undecodable_jpeg()) == (80, 60)
    with pytest.raises(cpu.DECODE_ERRORS):
        DeviceDecode(fast)(cut)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchvision 0.29's codecs (cpu.decode)
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest"])
def test_the_device_half_is_the_fast_paths_geometry_within_its_rounding(interpolation):
    """DeviceDecode's two halves against the fast path for the same seed, on 40 images of many sizes
    (full-scale decoding: no crop reaches twice the output): the same crop and flip, pixels apart by the
    rounding of the uint8 resize only. Measured: bilinear at most 1.0 (mean 0.29), bicubic 1.09 (0.30),
    nearest 0."""
    recipe = transforms.Recipe(interpolation=interpolation)
    sizes = np.random.default_rng(0).integers(40, 95, (40, 2))
    for fast in (cpu.FastTrainDecode(48, "RGB", recipe), cpu.FastEvalDecode(55, 48, "RGB", recipe)):
        decode, worst, means = DeviceDecode(fast), 0.0, []
        for seed, (w, h) in enumerate(sizes.tolist()):
            raw = encoded("baseline", seed, (w, h))
            torch.manual_seed(seed)
            want = fast(raw).float()
            torch.manual_seed(seed)
            jpeg, box = decode(raw)
            got = decode.finish(tio.decode_jpeg(jpeg, mode=decode.read_mode), box.tolist()).clamp(0, 255)
            diff = (got - want).abs()
            worst, means = max(worst, diff.max().item()), [*means, diff.mean().item()]
        assert worst <= BOUND[interpolation] + 1e-4 and np.mean(means) <= MEAN_BOUND, (type(fast).__name__, worst)


@pytest.mark.parametrize("source,chans", [("folder", 3), ("shards", 3), ("folder", 1)])
def test_training_batches_have_the_fast_paths_crops_and_flips(folder, shard_set, source, chans):
    """The same seed gives the same batches as TRAIN.IMAGE_DECODE fast: the same images and labels in the
    same order, the device-decoded ones within BOUND, the ones decoded in the worker (progressive, CMYK, PNG)
    bit for bit; gray JPEGs come out RGB, and every image gray for a 1-channel model, as on the fast path."""
    root, chans_opt = folder if source == "folder" else shard_set, {"MODEL.IN_CHANS": chans}
    fast_cfg, gpu_cfg = make_cfg(opts(root, "fast", **chans_opt)), make_cfg(opts(root, "gpu", **chans_opt))
    fast, gpu = epoch(fast_cfg), epoch(gpu_cfg)
    assert len(gpu) == len(fast) == 5
    assert isinstance(data.build_train_loader(gpu_cfg, 0, 1, CPU), DecodedBatches)
    exact = 0
    for (a, ya), (b, yb) in zip(fast, gpu):
        assert torch.equal(ya, yb) and a.shape == b.shape == (4, chans, 32, 32)
        diff = (pixels(a, fast_cfg) - pixels(b, gpu_cfg)).abs().flatten(1)
        assert diff.max() <= BOUND["bilinear"] + 1e-3 and diff.mean() <= MEAN_BOUND
        exact += int((diff.max(1).values == 0).sum())
    assert exact >= 8  # the 8 progressive, CMYK and PNG files (of 20), at least, are the fast path's own


@pytest.mark.parametrize("source", ["folder", "shards"])
def test_a_resumed_epoch_gives_the_straight_runs_batches(folder, shard_set, source):
    """A loader built anew and started 3 batches into the epoch (a resumed run) continues with the
    straight run's batches, bit for bit: the crops are drawn in the workers from per-item seeds."""
    cfg = make_cfg(opts(folder if source == "folder" else shard_set, "gpu"))
    whole, rest = epoch(cfg), epoch(cfg, start=3 * 4)
    assert len(rest) == len(whole) - 3
    assert all(torch.equal(a, b) and torch.equal(ya, yb) for (a, ya), (b, yb) in zip(rest, whole[3:]))


def test_evaluation_is_exact_over_ranks_and_leaves_out_unreadable_images(tmp_path, caplog):
    """Two ranks' evaluation loaders: every readable image once, the same pixels as the fast path within
    BOUND; a truncated JPEG (the worker's) and one neither decoder reads (the main process's) left out,
    named and counted."""
    root = str(tmp_path / "d")
    write_folder(root, extra={"cut.jpg": encoded("baseline", 5)[:-300], "tables.jpg": undecodable_jpeg()})
    fast_cfg, gpu_cfg = make_cfg(opts(root, "fast")), make_cfg(opts(root, "gpu"))
    seen: dict[str, list] = {"fast": [], "gpu": []}
    bad = {"fast": 0, "gpu": 0}
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        for rank in (0, 1):
            for name, cfg in (("fast", fast_cfg), ("gpu", gpu_cfg)):
                loader = data.build_test_loader(cfg, rank, 2, CPU)
                seen[name] += [(pixels(x, cfg), y) for x, y in loader]
                bad[name] += len(data.take_unreadable(loader.dataset))
    assert bad == {"fast": 2, "gpu": 2}
    fast_x, gpu_x = (torch.cat([x for x, _ in seen[k]]) for k in ("fast", "gpu"))
    assert len(gpu_x) == 20 and torch.equal(torch.cat([y for _, y in seen["gpu"]]),
                                            torch.cat([y for _, y in seen["fast"]]))
    assert (fast_x - gpu_x).abs().max() <= BOUND["bilinear"] + 1e-3
    # This process logs what it skips itself (tables.jpg, with gpu); the workers' (cut.jpg) go to their stderr.
    assert [r.getMessage().split()[3] for r in caplog.records if "unreadable" in r.getMessage()] == [
        os.path.join(root, "train", "a", "tables.jpg")]


def test_an_image_neither_decoder_reads_is_skipped_in_training_or_stops_the_run(tmp_path, caplog):
    root = str(tmp_path / "d")
    write_folder(root, per_class=2, extra={"tables.jpg": undecodable_jpeg()})  # 5 images: 1 batch of 4
    cfg = make_cfg(opts(root, "gpu", **{"TRAIN.CROP_SCALE": [1.0, 1.0], "TRAIN.CROP_RATIO": [1.0, 2.0]}))
    loader = data.build_train_loader(cfg, 0, 1, CPU)
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        for _ in range(3):  # epochs: tables.jpg lands in the batch of 4 at least once
            loader.sampler.set_epoch(_)
            assert all(x.shape == (4, 3, 32, 32) and len(y) == 4 for x, y in loader)  # stood in for
    bad = len(data.take_unreadable(loader.dataset))
    assert bad >= 1 and sum("tables.jpg" in r.getMessage() for r in caplog.records) == bad
    failing = data.build_train_loader(make_cfg({**opts(root, "gpu"), "TRAIN.BAD_IMAGES": "fail"}), 0, 1, CPU)
    with pytest.raises(items.UnreadableImage, match=re.escape(os.path.join(root, "train", "a", "tables.jpg"))):
        for e in range(3):
            failing.sampler.set_epoch(e)
            list(failing)


def test_auto_is_the_fast_path_on_the_cpu_and_measures_on_cuda(folder, monkeypatch):
    """auto: on a machine without CUDA the folder is the LoaderPipeline's, fast; where CUDA is, the
    DeviceDecodePipeline, which on a CPU device is still the fast path. auto_choice, measured here on the
    CPU, says the rates it compared and picks the device only when the workers fall short."""
    cfg = make_cfg(opts(folder, "auto"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loading.pipeline_class(cfg, "TRAIN") is lpipeline.LoaderPipeline
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loading.pipeline_class(cfg, "TRAIN") is DeviceDecodePipeline
    assert type(data.build_train_loader(cfg, 0, 1, CPU)) is NormalizedBatches
    gpu = make_cfg(opts(folder, "gpu"))
    assert loading.pipeline_class(gpu, "TRAIN") is DeviceDecodePipeline
    assert not device.decodes_on_device(cfg, lpipeline.Place(0, 1, CPU), list)
    assert device.decodes_on_device(gpu, lpipeline.Place(0, 1, CPU), list)

    samples = [encoded("baseline", seed) for seed in range(8)]
    tiny = make_cfg({**opts(folder, "auto"), "MODEL.ARCH": "resnet_tiny", "TRAIN.BATCH_SIZE": 8})
    on_device, why = device.auto_choice(tiny, CPU, samples)
    per_worker, feed, model = (float(x) for x in re.search(
        r"2 workers x (\d+) img/s decoded on the CPU = (\d+) img/s, resnet_tiny trains at (\d+) img/s", why).groups())
    assert per_worker > 0 and model > 0 and abs(feed - 2 * per_worker) <= 1
    assert on_device == (feed < model) and why.startswith("gpu" if on_device else "fast")
    augmented = make_cfg({**opts(folder, "auto"), "TRAIN.AUTO_AUGMENT": "randaugment"})
    assert device.auto_choice(augmented, CPU, samples) == (
        False, "fast, since TRAIN.AUTO_AUGMENT's policies run in the workers, on decoded images")


def test_the_gpu_decode_key_is_checked():
    with pytest.raises(UserError, match="TRAIN.IMAGE_DECODE must be one of fast, pil, gpu, auto, got 'nvjpeg'"):
        make_cfg({"TRAIN.IMAGE_DECODE": "nvjpeg"})
    with pytest.raises(UserError, match="TRAIN.IMAGE_DECODE gpu decodes after the loader workers"):
        make_cfg({"TRAIN.IMAGE_DECODE": "gpu", "TRAIN.AUTO_AUGMENT": "trivialaugment"})
    assert make_cfg({"TRAIN.IMAGE_DECODE": "auto", "TRAIN.AUTO_AUGMENT": "trivialaugment"}).TRAIN.IMAGE_DECODE == "auto"


@pytest.mark.e2e
@pytest.mark.parametrize("source", ["folder", "shards"])
def test_a_run_stopped_mid_epoch_resumes_with_the_straight_runs_losses(folder, shard_set, source, tmp_path):
    """`distribuuuu train` with TRAIN.IMAGE_DECODE gpu on the CPU and 2 loader workers: stopped by SIGUSR1
    after step 3 of 10, resumed; every loss, bit for bit, as a straight run's; then `eval` of it."""
    words = ["--cfg", TINY, "TRAIN.DATASET", folder if source == "folder" else shard_set, "TEST.DATASET",
             folder if source == "folder" else shard_set, "TEST.SPLIT", "train", "MODEL.NUM_CLASSES", "2",
             "TRAIN.TOPK", "1", "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "36", "TRAIN.WORKERS", "2",
             "TRAIN.BATCH_SIZE", "4", "TRAIN.IMAGE_DECODE", "gpu", "TRAIN.PRINT_FREQ", "1"]  # 5 steps an epoch

    def run(out: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "tests/scripts/fault_run.py", *words, "OUT_DIR", out], cwd=ROOT,
                              env={**env(), "LOSS_LOG": f"{out}/loss", **extra}, capture_output=True, text=True,
                              timeout=300)

    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    check(run(straight))
    assert run(stopped, SIGNAL_AT="3:0:SIGUSR1").returncode != 0
    check(run(stopped))
    with open(f"{straight}/loss.rank0") as a, open(f"{stopped}/loss.rank0") as b:
        losses = a.read().split()
        assert len(losses) == 10 and losses == b.read().split()
    check(subprocess.run([sys.executable, "-m", "distribuuuu", "eval", *words, "OUT_DIR", straight], cwd=ROOT,
                         env=env(), capture_output=True, text=True, timeout=300))
    with open(f"{straight}/eval.jsonl") as f:
        assert json.loads(f.read().splitlines()[-1])["n"] == 20  # every image once
