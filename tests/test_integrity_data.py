"""Issue #14 item 7: the data is what it claims to be.

Real files throughout: real symlink loops and symlinked duplicates, a real 16-bit PNG, real
corrupt files in an evaluation set (1 and 2 processes), a class of unreadable files, and a batch
larger than the training set; each refusal is exit status 2 with one message, before any process
group starts.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

from distribuuuu import data, models
from distribuuuu.data import checks, images
from distribuuuu.errors import UserError
from distribuuuu.run_folder.metrics_files import read_jsonl
from tests.conftest import TINY, check, cli_main, distribuuuu, make_cfg, write_image_tree


def _tree(root, train=None, val=None) -> str:
    """root/train and root/val image trees (classes 0, 1, 2 of 4 images by default)."""
    write_image_tree(str(root), "train", train or {"0": 4, "1": 4, "2": 4}, size=(10, 10))
    write_image_tree(str(root), "val", val or {"0": 2, "1": 2, "2": 2}, size=(10, 10))
    return str(root)


def _folder_cfg(root: str, **extra) -> object:
    return make_cfg({"TRAIN.DATASET": root, "TEST.DATASET": root, "MODEL.NUM_CLASSES": 3, "TRAIN.TOPK": 1,
                     "TRAIN.IM_SIZE": 8, "TEST.IM_SIZE": 8, "TRAIN.BATCH_SIZE": 2, "TEST.BATCH_SIZE": 3,
                     "TRAIN.WORKERS": 0, **extra})


def _train_args(root: str, out: str, *extra: str) -> list[str]:
    return ["train", "--cfg", TINY, "TRAIN.DATASET", root, "TEST.DATASET", root, "MODEL.NUM_CLASSES", "3",
            "TRAIN.TOPK", "1", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "4",
            "TEST.BATCH_SIZE", "3", "OPTIM.MAX_EPOCH", "1", "OUT_DIR", out, *extra]


def _user_error(proc, *parts: str) -> str:
    """Exit 2, one line on stderr holding every part, no traceback; returns that line."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(lines) == 1, proc.stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------------
# Symlink loops and duplicates
# ---------------------------------------------------------------------------------------------
def test_symlink_loop_in_a_class_is_refused_naming_the_link(tmp_path):
    root = _tree(tmp_path / "ds")
    link = os.path.join(root, "train", "2", "loop")
    os.symlink("..", link)  # train/2/loop -> train: os.walk would follow it until the path is too long
    out = str(tmp_path / "run")
    line = _user_error(cli_main(*_train_args(root, out)), "TRAIN.DATASET", link,
                       os.path.realpath(os.path.join(root, "train")), "loop")
    assert "rm " + link in line
    assert not os.path.exists(os.path.join(out, "checkpoints"))  # refused before anything ran
    # The walk lists each real image once and never enters the loop.
    listing = images.list_split(os.path.join(root, "train"), ["0", "1", "2"])
    assert [listing.count(c) for c in "012"] == [4, 4, 4] and listing.loops == [(link, listing.loops[0][1])]
    with pytest.raises(UserError, match="loop"):  # the dataset itself refuses too (no preflight needed)
        data.build_dataset(_folder_cfg(root), train=True)


def test_loop_through_two_links_is_found(tmp_path):
    """train/0/away -> pool, pool/back -> train/0: no link points to its own ancestor by path alone."""
    root = _tree(tmp_path / "ds")
    pool = tmp_path / "pool"
    pool.mkdir()
    Image.new("RGB", (10, 10)).save(pool / "p.png")
    os.symlink(str(pool), os.path.join(root, "train", "0", "away"))
    os.symlink(os.path.join(root, "train", "0"), str(pool / "back"))
    listing = images.list_split(os.path.join(root, "train"), ["0", "1", "2"])
    assert listing.count("0") == 5  # its 4 images and pool/p.png, once
    assert listing.loops == [(os.path.join(root, "train", "0", "away", "back"), os.path.join(root, "train", "0"))]


def test_symlinked_duplicate_file_is_refused_and_keep_keeps_it(tmp_path):
    root = _tree(tmp_path / "ds")
    train = os.path.join(root, "train")
    os.symlink(os.path.join(train, "0", "0.png"), os.path.join(train, "1", "dup.png"))
    line = _user_error(cli_main(*_train_args(root, str(tmp_path / "run"))),
                       "1 image file(s)", "1/dup.png is 0/0.png", "TRAIN.DUPLICATE_IMAGES keep")
    assert "TRAIN.DATASET" in line
    # keep: every listed path is a sample, as torchvision's ImageFolder lists them (oversampling)
    keep = _folder_cfg(root, **{"TRAIN.DUPLICATE_IMAGES": "keep"})
    data.check_datasets(keep, 1)
    assert len(data.build_dataset(keep, train=True)) == 13


def test_symlinked_folder_duplicates_are_counted(tmp_path):
    """A class folder linked inside another lists all its files again: 4 duplicates, not 1."""
    root = _tree(tmp_path / "ds")
    train = os.path.join(root, "train")
    os.symlink(os.path.join(train, "0"), os.path.join(train, "2", "more"))
    with pytest.raises(UserError, match=r"4 image file\(s\).*2/more/0.png is 0/0.png"):
        data.check_datasets(_folder_cfg(root), 1)


def test_symlinked_class_folders_pointing_elsewhere_are_fine(tmp_path):
    """The common layout of class folders linked from elsewhere is neither a loop nor a duplicate,
    and lists exactly what torchvision's ImageFolder lists."""
    real = _tree(tmp_path / "real")
    ds = tmp_path / "ds"
    for split in ("train", "val"):
        (ds / split).mkdir(parents=True)
        for c in "012":
            os.symlink(os.path.join(real, split, c), str(ds / split / c))
    cfg = _folder_cfg(str(ds))
    data.check_datasets(cfg, 1)
    ours = data.build_dataset(cfg, train=True).samples
    from torchvision.datasets import ImageFolder
    assert ours == ImageFolder(str(ds / "train")).samples and len(ours) == 12


# ---------------------------------------------------------------------------------------------
# 16-bit images
# ---------------------------------------------------------------------------------------------
def _png16(path: str) -> np.ndarray:
    """A 16-bit gray PNG whose 1,024 values span 0..65535 (every 64th value, and 65535)."""
    values = (np.arange(32 * 32, dtype=np.int64) * 64).clip(0, 65535)
    values[-1] = 65535
    values = values.astype(np.uint16).reshape(32, 32)
    Image.fromarray(values).save(path)
    return values


def test_16bit_png_is_scaled_not_clipped_on_both_decode_paths(tmp_path):
    path = str(tmp_path / "deep.png")
    values = _png16(path)
    assert Image.open(path).mode == "I;16"  # what PIL makes of it: the mode that used to be clipped
    want = (values >> 8).astype(np.uint8)  # the high byte, 0..255
    pil_gray = np.asarray(images.open_image(path, "L"))
    pil_rgb = np.asarray(images.open_image(path, "RGB"))
    with open(path, "rb") as f:
        raw = f.read()
    fast_gray = images.decode(raw, "L")[0].numpy()
    fast_rgb = images.decode(raw, "RGB").permute(1, 2, 0).numpy()
    fast_eval = images.FastEvalDecode(32, 32, "L")(path)[0].numpy()  # resize to its own size: no-op
    for got in (pil_gray, fast_gray, fast_eval, *(rgb[..., c] for rgb in (pil_rgb, fast_rgb) for c in range(3))):
        np.testing.assert_array_equal(got, want)
    assert want.min() == 0 and want.max() == 255 and (want == 255).mean() < 0.01  # was 99% white


def test_32bit_and_float_gray_images_are_scaled():
    ints = Image.fromarray(np.array([[0, 256, 65535, 70000]], dtype=np.int32))  # mode I: read as 16-bit
    assert ints.mode == "I"
    assert np.asarray(images.to_8bit(ints)).tolist() == [[0, 1, 255, 255]]
    unit = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))  # mode F in [0, 1]
    assert np.asarray(images.to_8bit(unit)).tolist() == [[0, 128, 255]]
    rgb = Image.new("RGB", (2, 2), (1, 2, 3))
    assert images.to_8bit(rgb) is rgb  # 8-bit modes are left alone


# ---------------------------------------------------------------------------------------------
# Unreadable images in the evaluation set: left out, counted, for any world size
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eval_tree(tmp_path_factory):
    """val: 3 classes x 4 files, of which 2 cannot be decoded (10 readable); train: all readable."""
    root = tmp_path_factory.mktemp("evalbad") / "ds"
    _tree(root, val={"0": 4, "1": 4, "2": 4})
    (root / "val" / "0" / "1.png").write_bytes(b"")  # empty
    (root / "val" / "2" / "3.png").write_text("not an image\n")
    return str(root)


@pytest.mark.timeout(180)
@pytest.mark.e2e
def test_unreadable_eval_images_are_left_out_and_counted_with_1_and_2_processes(eval_tree, tmp_path):
    args = ["--cfg", TINY, "TEST.DATASET", eval_tree, "TRAIN.DATASET", eval_tree, "MODEL.NUM_CLASSES", "3",
            "TRAIN.TOPK", "1", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TEST.BATCH_SIZE", "3"]
    weights = str(tmp_path / "w.pth")  # an untrained model: what is counted matters here, not accuracy
    cfg = make_cfg(*args[2:], base=TINY)
    torch.save(models.build_model(cfg).state_dict(), weights)
    records, logs = [], ""
    for spawn in ([], ["--nproc-per-node", "2"]):  # one plain process, then two
        out = str(tmp_path / f"eval{len(spawn)}")
        proc = check(distribuuuu("eval", *spawn, *args, "MODEL.WEIGHTS", weights, "OUT_DIR", out))
        records.append(read_jsonl(os.path.join(out, "eval.jsonl"))[-1])  # eval records: eval.jsonl
        logs += open(os.path.join(out, "log.txt")).read() + proc.stderr
    # n: the 10 distinct readable images (12 if another sample had stood in for each bad one)
    assert [(r["split"], r["n"], r["bad_images"]) for r in records] == [("val", 10, 2), ("val", 10, 2)]
    assert records[0]["loss"] == pytest.approx(records[1]["loss"])  # exact: the same 10 images
    assert "0/1.png" in logs and "2/3.png" in logs and logs.count("2 unreadable images left out") == 2


def test_unreadable_eval_images_still_fail_with_bad_images_fail(eval_tree):
    cfg = _folder_cfg(eval_tree, **{"TRAIN.BAD_IMAGES": "fail"})
    loader = data.build_test_loader(cfg, 0, 1, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="cannot decode image .*1.png"):
        list(loader)


def test_eval_loader_yields_only_readable_images(eval_tree):
    """Two ranks' shards together hold each readable image once; a batch may shrink, never refill."""
    cfg = _folder_cfg(eval_tree, **{"TRAIN.IMAGE_DECODE": "pil"})
    seen = 0
    for rank in (0, 1):
        loader = data.build_test_loader(cfg, rank, 2, torch.device("cpu"))
        seen += sum(len(target) for _, target in loader)
        # 0/1.png is item 1 and 2/3.png item 11: both in rank 1's shard (odd items)
        assert data.take_bad_image_count(loader) == rank * 2
    assert seen == 10


# ---------------------------------------------------------------------------------------------
# Found before training starts: an unreadable class, a batch larger than the training set
# ---------------------------------------------------------------------------------------------
def test_class_whose_every_file_is_unreadable_is_refused(tmp_path):
    root = _tree(tmp_path / "ds")
    for i in range(4):
        (tmp_path / "ds" / "train" / "1" / f"{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    _user_error(cli_main(*_train_args(root, str(tmp_path / "run"))),
                "TRAIN.DATASET", "every image file of 1 class folder(s)", "1 (4 files;", "0.png")
    # One good file is enough: the class trains, its bad files are skipped as before.
    Image.new("RGB", (10, 10)).save(tmp_path / "ds" / "train" / "1" / "3.png")
    data.check_datasets(_folder_cfg(root), 1)


def test_truncated_jpeg_with_a_good_header_counts_as_unreadable(tmp_path):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    path = tmp_path / "cut.jpg"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    Image.open(path)  # the header opens ...
    assert checks.can_decode(str(path)) is not None  # ... but the image does not decode


def test_batch_larger_than_the_training_set_is_refused_with_the_numbers():
    proc = cli_main("train", "--nproc-per-node", "2", "--cfg", TINY, "TRAIN.SYNTHETIC_SAMPLES", "20",
                    "TRAIN.BATCH_SIZE", "16", "OUT_DIR", "/nonexistent/never/written")
    _user_error(proc, "20 training samples, 10 per process", "TRAIN.BATCH_SIZE 16 x 2 process(es) x "
                "TRAIN.ACCUM_STEPS 1 = 32", "set TRAIN.BATCH_SIZE 10 or less")
    cfg = make_cfg({"TRAIN.DATASET": "synthetic", "TEST.DATASET": "synthetic", "TRAIN.SYNTHETIC_SAMPLES": 64,
                    "TRAIN.BATCH_SIZE": 16, "TRAIN.ACCUM_STEPS": 3})
    data.check_datasets(cfg, 1)  # 64 >= 48: one step
    with pytest.raises(UserError, match=r"16 x 2 process\(es\) x TRAIN.ACCUM_STEPS 3 = 96.*BATCH_SIZE 10 or less"):
        data.check_datasets(cfg, 2)
