"""The data is what it claims to be (distribuuuu/data/checks/): symlink loops and symlinked
duplicates, images of 16 bits and more scaled rather than clipped, unreadable evaluation images left out
and counted, a class of unreadable files, a batch larger than the training set, and evaluation images
that are also training images (hard links, symlinks, byte copies).

Real files throughout; each refusal is exit status 2 with one message, before any process group
starts (docs/reliability.md).
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from distribuuuu import data, models
from distribuuuu.data.checks import overlap
from distribuuuu.data.decoding import cpu
from distribuuuu.data.sources import folder
from distribuuuu.data.sources.files import ImageFiles
from distribuuuu.errors import UserError
from distribuuuu.run_folder.metrics_files import read_jsonl
from tests.conftest import (
    TINY,
    check,
    check_user_error,
    cli_main,
    distribuuuu,
    make_cfg,
    run,
    write_image_tree,
)


def _tree(root, train=None, val=None) -> str:
    """root/train and root/val image trees (classes 0, 1, 2 of 4 images by default)."""
    write_image_tree(str(root), "train", train or {"0": 4, "1": 4, "2": 4}, size=(10, 10))
    write_image_tree(str(root), "val", val or {"0": 2, "1": 2, "2": 2}, size=(10, 10))
    return str(root)


def _distinct_tree(root) -> str:
    """root/train (classes 0, 1, 2 of 4 images) and root/val (2 each), every image distinct."""
    write_image_tree(str(root), "train", {"0": 4, "1": 4, "2": 4}, size=(10, 10))
    write_image_tree(str(root), "val", {"0": 2, "1": 2, "2": 2}, size=(9, 11))  # another size: other bytes
    return str(root)


def _folder_cfg(root: str, **extra) -> object:
    """The folder root at 8 px, 3 classes, batches of 2 (train) and 3: this module's own defaults."""
    return make_cfg({"TRAIN.DATASET": root, "TEST.DATASET": root, "MODEL.NUM_CLASSES": 3, "TRAIN.TOPK": 1,
                     "TRAIN.IM_SIZE": 8, "TEST.IM_SIZE": 8, "TRAIN.BATCH_SIZE": 2, "TEST.BATCH_SIZE": 3,
                     "TRAIN.WORKERS": 0, **extra})


def _train_args(root: str, out: str, *extra: str) -> list[str]:
    return ["train", "--cfg", TINY, "TRAIN.DATASET", root, "TEST.DATASET", root, "MODEL.NUM_CLASSES", "3",
            "TRAIN.TOPK", "1", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "4",
            "TEST.BATCH_SIZE", "3", "OPTIM.MAX_EPOCH", "1", "OUT_DIR", out, *extra]


# ---------------------------------------------------------------------------------------------
# Symlink loops and duplicates
# ---------------------------------------------------------------------------------------------
def test_symlink_loop_in_a_class_is_refused_naming_the_link(tmp_path):
    root = _tree(tmp_path / "ds")
    link = os.path.join(root, "train", "2", "loop")
    os.symlink("..", link)  # train/2/loop -> train: os.walk would follow it until the path is too long
    out = str(tmp_path / "run")
    line = check_user_error(cli_main(*_train_args(root, out)), "TRAIN.DATASET", link,
                       os.path.realpath(os.path.join(root, "train")), "loop")
    assert "rm " + link in line
    assert not os.path.exists(os.path.join(out, "checkpoints"))  # refused before anything ran
    # The walk lists each real image once and never enters the loop.
    listing = folder.list_split(os.path.join(root, "train"), ["0", "1", "2"])
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
    listing = folder.list_split(os.path.join(root, "train"), ["0", "1", "2"])
    assert listing.count("0") == 5  # its 4 images and pool/p.png, once
    assert listing.loops == [(os.path.join(root, "train", "0", "away", "back"), os.path.join(root, "train", "0"))]


def test_symlinked_duplicate_file_is_refused_and_keep_keeps_it(tmp_path):
    root = _tree(tmp_path / "ds")
    train = os.path.join(root, "train")
    os.symlink(os.path.join(train, "0", "0.png"), os.path.join(train, "1", "dup.png"))
    line = check_user_error(cli_main(*_train_args(root, str(tmp_path / "run"))),
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
    built = data.build_dataset(cfg, train=True)
    ours = list(zip(built.files.paths, built.targets))
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
    with open(path, "rb") as f:
        raw = f.read()
    pil_gray = np.asarray(cpu.open_image(raw, "L"))
    pil_rgb = np.asarray(cpu.open_image(raw, "RGB"))
    fast_gray = cpu.decode(raw, "L")[0].numpy()
    fast_rgb = cpu.decode(raw, "RGB").permute(1, 2, 0).numpy()
    fast_eval = cpu.FastEvalDecode(32, 32, "L")(raw)[0].numpy()  # resize to its own size: no-op
    for got in (pil_gray, fast_gray, fast_eval, *(rgb[..., c] for rgb in (pil_rgb, fast_rgb) for c in range(3))):
        np.testing.assert_array_equal(got, want)
    assert want.min() == 0 and want.max() == 255 and (want == 255).mean() < 0.01  # was 99% white


def test_32bit_and_float_gray_images_are_scaled():
    ints = Image.fromarray(np.array([[0, 256, 65535, 70000]], dtype=np.int32))  # mode I: read as 16-bit
    assert ints.mode == "I"
    assert np.asarray(cpu.to_8bit(ints)).tolist() == [[0, 1, 255, 255]]
    unit = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))  # mode F in [0, 1]
    assert np.asarray(cpu.to_8bit(unit)).tolist() == [[0, 128, 255]]
    rgb = Image.new("RGB", (2, 2), (1, 2, 3))
    assert cpu.to_8bit(rgb) is rgb  # 8-bit modes are left alone


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
        assert len(data.take_unreadable(loader)) == rank * 2
    assert seen == 10


# ---------------------------------------------------------------------------------------------
# Found before training starts: an unreadable class, a batch larger than the training set
# ---------------------------------------------------------------------------------------------
def test_class_whose_every_file_is_unreadable_is_refused(tmp_path):
    root = _tree(tmp_path / "ds")
    for i in range(4):
        (tmp_path / "ds" / "train" / "1" / f"{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    check_user_error(cli_main(*_train_args(root, str(tmp_path / "run"))),
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
    assert cpu.can_decode(path.read_bytes()) is not None  # ... but the image does not decode


def test_batch_larger_than_the_training_set_is_refused_with_the_numbers():
    proc = cli_main("train", "--nproc-per-node", "2", "--cfg", TINY, "TRAIN.SYNTHETIC_SAMPLES", "20",
                    "TRAIN.BATCH_SIZE", "16", "OUT_DIR", "/nonexistent/never/written")
    check_user_error(proc, "20 training samples, 10 per process", "TRAIN.BATCH_SIZE 16 x 2 process(es) x "
                "TRAIN.ACCUM_STEPS 1 = 32", "set TRAIN.BATCH_SIZE 10 or less")
    cfg = make_cfg({"TRAIN.DATASET": "synthetic", "TEST.DATASET": "synthetic", "TRAIN.SYNTHETIC_SAMPLES": 64,
                    "TRAIN.BATCH_SIZE": 16, "TRAIN.ACCUM_STEPS": 3})
    data.check_datasets(cfg, 1)  # 64 >= 48: one step
    with pytest.raises(UserError, match=r"16 x 2 process\(es\) x TRAIN.ACCUM_STEPS 3 = 96.*BATCH_SIZE 10 or less"):
        data.check_datasets(cfg, 2)

# ---------------------------------------------------------------------------------------------
# Evaluation images that are also training images (TRAIN.OVERLAP), hard links inside a split
# ---------------------------------------------------------------------------------------------
def _leak(root: str) -> None:
    """val/0/0.png hard-linked, val/1/0.png symlinked and val/2/1.png copied into train."""
    val, train = os.path.join(root, "val"), os.path.join(root, "train")
    os.link(os.path.join(val, "0", "0.png"), os.path.join(train, "0", "hard.png"))
    os.symlink(os.path.join(val, "1", "0.png"), os.path.join(train, "1", "soft.png"))
    shutil.copyfile(os.path.join(val, "2", "1.png"), os.path.join(train, "2", "copy.png"))


def test_hard_link_symlink_and_copy_of_val_images_are_each_reported(tmp_path, caplog):
    root = _distinct_tree(tmp_path / "ds")
    overlap.check_overlap(_folder_cfg(root), is_main=True)  # a clean pair of splits: no warning
    assert not [r for r in caplog.records if "TEST.DATASET" in r.getMessage()]
    _leak(root)
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        overlap.check_overlap(_folder_cfg(root), is_main=True)
    [line] = [r.getMessage() for r in caplog.records if "also in TEST.DATASET" in r.getMessage()]
    assert line.startswith("3 image(s) of TRAIN.DATASET are also in TEST.DATASET (1 hard link, 1 symlink, "
                           "1 same bytes)"), line
    for example in ("train/0/hard.png is val/0/0.png (hard link)", "train/1/soft.png is val/1/0.png (symlink)",
                    "train/2/copy.png is val/2/1.png (same bytes)"):
        assert example in line, (example, line)
    with pytest.raises(UserError, match=r"^3 image\(s\) of TRAIN.DATASET are also in TEST.DATASET"):
        overlap.check_overlap(_folder_cfg(root, **{"TRAIN.OVERLAP": "error"}), is_main=True)
    caplog.clear()
    overlap.check_overlap(_folder_cfg(root, **{"TRAIN.OVERLAP": "off"}), is_main=True)
    assert not caplog.records


def test_only_files_of_a_size_the_other_split_has_are_read(tmp_path, monkeypatch):
    root = _distinct_tree(tmp_path / "ds")
    _leak(root)
    big = os.path.join(root, "train", "0", "big.png")
    with open(big, "wb") as f:  # a size no val image has: it must never be opened
        f.write(os.urandom(3 << 20))
    near = os.path.join(root, "train", "1", "near.png")  # the size of a val image, other bytes
    val_file = os.path.join(root, "val", "1", "1.png")
    with open(near, "wb") as f:
        f.write(os.urandom(os.path.getsize(val_file)))
    for split in ("train", "val"):  # two empty (unreadable) files: the same bytes, but not a copied image
        open(os.path.join(root, split, "0", "empty.png"), "wb").close()
    read = []
    real_read = overlap._read
    monkeypatch.setattr(overlap, "_read", lambda files, i: read.append(files.name(i)) or real_read(files, i))
    found = overlap.find(*(_files(sorted(p for p, _ in folder.list_split(os.path.join(root, s), list("012"))
                                         .samples())) for s in ("train", "val")))
    assert sorted(h for *_, h in found.pairs) == ["hard link", "same bytes", "symlink"]
    assert big not in read and near in read
    # Train images are 10x10, val 9x11: distinct sizes, so only the copy, near.png and the val files
    # of their sizes are read (hard and symbolic links are found by their inode, unread).
    train_read = {p for p in read if os.sep + "train" + os.sep in p}
    assert train_read == {os.path.join(root, "train", "2", "copy.png"), near}, train_read


def test_files_sharing_a_size_and_a_header_are_each_read_once(tmp_path, monkeypatch):
    """Same-size files that share their first 4 KiB (raw images of one format) are grouped by a hash of the
    whole file: each is read once, however many share a size (a pairwise comparison would be quadratic)."""
    header, paths = os.urandom(4096), {"train": [], "val": []}
    for split, n in (("train", 300), ("val", 100)):
        os.makedirs(tmp_path / split)
        for i in range(n):
            path = tmp_path / split / f"{i}.ppm"
            path.write_bytes(header + os.urandom(100))
            paths[split].append(str(path))
    for i in (3, 50):
        shutil.copyfile(paths["val"][i], tmp_path / "train" / f"copy{i}.ppm")
        paths["train"].append(str(tmp_path / "train" / f"copy{i}.ppm"))
    read = []
    real_read = overlap._read
    monkeypatch.setattr(overlap, "_read", lambda files, i: read.append(files.name(i)) or real_read(files, i))
    found = overlap.find(_files(paths["train"]), _files(paths["val"]))
    assert sorted((os.path.basename(a), os.path.basename(b), how) for a, b, how in found.pairs) == [
        ("copy3.ppm", "3.ppm", "same bytes"), ("copy50.ppm", "50.ppm", "same bytes")]
    assert sorted(read) == sorted(paths["train"] + paths["val"]) and found.read == len(read) == 402


def test_hard_links_inside_train_are_refused_like_symlinks(tmp_path):
    root = _distinct_tree(tmp_path / "ds")
    train = os.path.join(root, "train")
    os.link(os.path.join(train, "0", "1.png"), os.path.join(train, "2", "again.png"))
    with pytest.raises(UserError, match=r"1 image file\(s\) in .* symlinks or hard links.*2/again.png is 0/1.png"):
        data.check_datasets(_folder_cfg(root), 1)
    # through a symlink to another hard link of a listed file: the same file too
    os.remove(os.path.join(train, "2", "again.png"))
    outside = tmp_path / "outside.png"
    os.link(os.path.join(train, "0", "1.png"), outside)
    os.symlink(str(outside), os.path.join(train, "1", "via.png"))
    with pytest.raises(UserError, match=r"1 image file\(s\).*1/via.png is 0/1.png"):
        data.check_datasets(_folder_cfg(root), 1)
    data.check_datasets(_folder_cfg(root, **{"TRAIN.DUPLICATE_IMAGES": "keep"}), 1)  # deliberate oversampling


@pytest.mark.e2e
def test_overlap_error_is_exit_2_with_one_line_from_the_installed_command(tmp_path):
    root = _distinct_tree(tmp_path / "ds")
    _leak(root)
    command = os.path.join(os.path.dirname(sys.executable), "distribuuuu")  # the console script
    out = tmp_path / "refused"
    line = check_user_error(run([command, *_train_args(root, str(out), "TRAIN.OVERLAP", "error")]),
                            "TRAIN.OVERLAP error")
    assert line.startswith("error: 3 image(s) of TRAIN.DATASET are also in TEST.DATASET")
    assert not out.exists()  # refused: no run folder left
    # warn (the default): the run goes on, and log.txt says it once with the examples
    out = tmp_path / "warned"
    check(run([command, *_train_args(root, str(out))]))
    log = (out / "log.txt").read_text()
    assert log.count("3 image(s) of TRAIN.DATASET are also in TEST.DATASET") == 1, log[-3000:]
    assert "train/0/hard.png is val/0/0.png (hard link)" in log


@pytest.mark.e2e
def test_overlap_error_on_two_ranks_ends_both_without_a_hang_and_leaves_no_folder(tmp_path):
    """Rank 0 looks, rank 1 waits for its verdict (a broadcast): both end with exit 2 and the same
    message, which the spawner prints once."""
    root = _distinct_tree(tmp_path / "ds")
    _leak(root)
    out = tmp_path / "run"
    proc = distribuuuu(*_train_args(root, str(out), "TRAIN.BATCH_SIZE", "2", "TRAIN.OVERLAP", "error"),
                       "--nproc-per-node", "2")
    check(proc, 2)
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert line.startswith("error: ") and "3 image(s) of TRAIN.DATASET are also in TEST.DATASET" in line, proc.stderr
    assert not out.exists(), os.listdir(out)  # the spawner's preflight made it; the refusal took it away


def _files(paths: list[str]) -> ImageFiles:
    """The image files at paths, as a reader gives them to the checks."""
    return ImageFiles("", ["0"], list(paths), [0] * len(paths))
