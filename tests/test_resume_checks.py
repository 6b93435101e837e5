"""What a resume checks before it continues a run, each case done for real: an edited config against a
real run folder (an identity key refused, a recipe key only with TRAIN.RESUME_ALLOW), another dataset
size on disk, real bytes flipped inside a checkpoint's tensor data, a metrics.jsonl torn mid-line
(docs/reliability.md)."""

import hashlib
import json
import os
import shutil
import zipfile

import pytest
import torch

from distribuuuu import config
from distribuuuu.errors import UserError
from distribuuuu.run_folder import RunFolder
from distribuuuu.tools import export, predict
from distribuuuu.weights import load_checkpoint
from tests.conftest import (
    TINY,
    check,
    distribuuuu,
    make_cfg,
    read_metrics,
    write_image,
    write_image_tree,
)


def _train(out: str, *opts: str, status: int = 0):
    return check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, *opts), status)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """One real 2-epoch synthetic_tiny run; each test works on a copy (_copy_run)."""
    out = str(tmp_path_factory.mktemp("base") / "run")
    _train(out)
    return out


def _copy_run(src: str, dst: str) -> str:
    """copytree, then last.pth / best.pth made hard links again, as the run left them."""
    shutil.copytree(src, dst)
    folder, src_folder = os.path.join(dst, "checkpoints"), os.path.join(src, "checkpoints")
    for link in ("last.pth", "best.pth"):
        target = next(n for n in os.listdir(src_folder) if n.startswith("epoch_")
                      and os.path.samefile(os.path.join(src_folder, n), os.path.join(src_folder, link)))
        os.remove(os.path.join(folder, link))
        os.link(os.path.join(folder, target), os.path.join(folder, link))
    return dst


def _snapshot(out: str, with_config: bool = True) -> dict[str, tuple[str, int]]:
    """name -> (sha256, inode) of every checkpoint file, and config.yaml's text. (A refusal found
    inside the run, after the config check passed, leaves config.yaml holding the latest attempt's
    config, as every resume does; the checkpoints are what must not change.)"""
    folder = os.path.join(out, "checkpoints")
    snap = {n: (hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest(),
                os.stat(os.path.join(folder, n)).st_ino) for n in os.listdir(folder)}
    if with_config:
        snap["config.yaml"] = (open(os.path.join(out, "config.yaml")).read(), 0)
    return snap


def _flip_tensor_byte(path: str) -> None:
    """Flip one bit in the middle of the largest tensor record's data (not in any zip header)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        pos = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.e2e
def test_an_identity_key_change_is_refused_and_touches_nothing(base_run, tmp_path):
    out = _copy_run(base_run, str(tmp_path / "run"))
    before = _snapshot(out)
    proc = _train(out, "MODEL.ARCH", "resnet_mini", "OPTIM.MAX_EPOCH", "3", status=2)
    err = proc.stderr
    assert "MODEL.ARCH: 'resnet_tiny' -> 'resnet_mini'" in err and "Traceback" not in err
    assert f"OUT_DIR {out}_2" in err and f"MODEL.WEIGHTS {out}/checkpoints/last.pth" in err
    assert "OPTIM.MAX_EPOCH" not in err  # a safe key is not listed among the refused ones
    assert _snapshot(out) == before  # checkpoints (bytes and inodes) and config.yaml untouched


@pytest.mark.e2e
def test_a_recipe_change_needs_resume_allow_and_safe_changes_are_logged(base_run, tmp_path):
    out = _copy_run(base_run, str(tmp_path / "run"))
    before = _snapshot(out)
    refused = _train(out, "OPTIM.BASE_LR", "0.1", "OPTIM.MAX_EPOCH", "3", status=2)
    assert "OPTIM.BASE_LR: 0.05 -> 0.1" in refused.stderr
    assert "TRAIN.RESUME_ALLOW \"['OPTIM.BASE_LR']\"" in refused.stderr
    assert _snapshot(out) == before
    proc = _train(out, "OPTIM.MAX_EPOCH", "3", "TRAIN.PRINT_FREQ", "2",
                  "OPTIM.BASE_LR", "0.1", "TRAIN.RESUME_ALLOW", "['OPTIM.BASE_LR']")
    for line in ("resume: OPTIM.MAX_EPOCH changed 2 -> 3", "resume: TRAIN.PRINT_FREQ changed 4 -> 2",
                 "resume: OPTIM.BASE_LR changed 0.05 -> 0.1", "2 epochs done, 0 samples into epoch 3"):
        assert line in proc.stdout
    assert [(m["epoch"], m["split"]) for m in read_metrics(out)] == [
        (1, "train"), (1, "val"), (2, "train"), (2, "val"), (3, "train"), (3, "val")]
    assert load_checkpoint(os.path.join(out, "checkpoints", "last.pth"))["epoch"] == 3


@pytest.mark.e2e
def test_a_state_that_does_not_fit_is_one_message(base_run, tmp_path):
    out = _copy_run(base_run, str(tmp_path / "run"))
    before = _snapshot(out, with_config=False)
    # Allowed explicitly, the shapes and the optimizer state are still checked: one message, no traceback.
    opt = _train(out, "OPTIM.OPTIMIZER", "adamw", "TRAIN.RESUME_ALLOW", "['OPTIM.OPTIMIZER']", status=2)
    assert "belongs to another optimizer" in opt.stderr and "KeyError" not in opt.stderr
    heads = _train(out, "MODEL.NUM_CLASSES", "3", "TRAIN.RESUME_ALLOW", "['MODEL.NUM_CLASSES']", status=2)
    assert "do not fit the model: 0 missing, 0 unexpected, 2 of another shape (fc.weight (4, " in heads.stderr
    for proc in (opt, heads):
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 4, proc.stderr
    assert _snapshot(out, with_config=False) == before


@pytest.mark.e2e
def test_a_dataset_of_another_size_is_refused(tmp_path):
    data = str(tmp_path / "data")
    write_image_tree(data, "train", {"a": 8, "b": 8}, size=(8, 8))
    write_image_tree(data, "val", {"a": 2, "b": 2}, size=(8, 8))
    out = str(tmp_path / "run")
    opts = ["TRAIN.DATASET", data, "TEST.DATASET", data, "MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8",
            "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "TRAIN.DATA_PIPELINE", "loader"]
    _train(out, *opts, "OPTIM.MAX_EPOCH", "1")
    before = _snapshot(out, with_config=False)
    write_image_tree(data, "train", {"a": 12, "b": 8}, size=(8, 8))  # 4 more images under the same path
    proc = _train(out, *opts, "OPTIM.MAX_EPOCH", "2", status=2)
    assert f"the training set ({data}, split 'train') has 20 samples now, 16 when the checkpoint was written" \
        in proc.stderr
    assert "Traceback" not in proc.stderr and "is not in" not in proc.stderr
    assert _snapshot(out, with_config=False) == before


@pytest.mark.e2e
def test_flipped_bytes_are_detected_skipped_on_resume_and_refused_by_tools(base_run, tmp_path):
    out = _copy_run(base_run, str(tmp_path / "run"))
    last = os.path.join(out, "checkpoints", "last.pth")
    _flip_tensor_byte(last)  # last.pth is a hard link: epoch_0002.pth changes with it
    copy = str(tmp_path / "copied.pth")
    shutil.copyfile(last, copy)
    torch.load(copy, map_location="cpu", weights_only=True)  # torch itself does not notice
    proc = check(distribuuuu("eval", "--cfg", TINY, "MODEL.WEIGHTS", copy, "OUT_DIR", str(tmp_path / "ev")), 2)
    assert f"{copy} is damaged" in proc.stderr and "SHA-256 mismatch in model" in proc.stderr
    assert "Traceback" not in proc.stderr
    # export and predict read weights through the same loader (in this process: one start-up less)
    image = str(tmp_path / "img.png")
    write_image(image, (16, 16), "RGB", seed=0)
    with pytest.raises(UserError, match=f"{copy} is damaged"):
        export.main(TINY, ["MODEL.WEIGHTS", copy], str(tmp_path / "ex"), 1e-4, 2)
    with pytest.raises(UserError, match=f"{copy} is damaged"):
        predict.main(TINY, ["MODEL.WEIGHTS", copy, image], 2)
    assert not os.path.exists(tmp_path / "ex")
    proc = _train(out, "OPTIM.MAX_EPOCH", "3")
    assert f"skipping damaged checkpoint {last}" in proc.stderr + proc.stdout
    assert "skipping damaged checkpoint " + os.path.join(out, "checkpoints", "epoch_0002.pth") not in proc.stdout
    assert f"resumed from {out}/checkpoints/epoch_0001.pth: 1 epochs done" in proc.stdout
    assert load_checkpoint(last)["epoch"] == 3


def test_every_checkpoint_damaged_is_refused_not_overwritten(tmp_path, caplog):
    out = str(tmp_path)
    folder = RunFolder(make_cfg("OUT_DIR", out, base=TINY))
    for epoch in (1, 2):
        folder.save({"model": {"w": torch.arange(4096, dtype=torch.float32) * epoch}, "epoch": epoch}, is_best=False)
    for name in ("epoch_0001.pth", "last.pth"):
        _flip_tensor_byte(os.path.join(out, "checkpoints", name))
    with pytest.raises(UserError, match="no intact checkpoint to resume .*epoch_0001.pth.*move them away"):
        folder.latest()
    assert caplog.text.count("skipping damaged checkpoint") == 2  # last.pth and epoch_0002.pth: read once


@pytest.mark.e2e
def test_a_torn_record_and_records_after_the_checkpoint_are_moved(base_run, tmp_path):
    out = _copy_run(base_run, str(tmp_path / "run"))
    folder = os.path.join(out, "checkpoints")
    # As if a kill hit while epoch 2's val record was written, before its checkpoint landed.
    os.remove(os.path.join(folder, "epoch_0002.pth"))
    os.remove(os.path.join(folder, "last.pth"))
    os.link(os.path.join(folder, "epoch_0001.pth"), os.path.join(folder, "last.pth"))
    path = os.path.join(out, "metrics.jsonl")
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text[:-25])  # the last line (epoch 2 val) loses its end and its newline
    proc = _train(out)
    assert "resumed from" in proc.stdout and "1 epochs done" in proc.stdout
    moved = f"moved to {out}/metrics_dropped.jsonl: "
    assert f"line 4 {moved}torn by an interrupted write" in proc.stdout
    assert f"line 3 {moved}records written after the checkpoint the run resumes from (epoch 1)" in proc.stdout
    lines = open(path).read().splitlines()
    records = [json.loads(line) for line in lines]  # every line parses
    assert [(m["epoch"], m["split"]) for m in records] == [(1, "train"), (1, "val"), (2, "train"), (2, "val")]
    dropped = [json.loads(line) for line in open(os.path.join(out, "metrics_dropped.jsonl"))]
    assert [d["line"] for d in dropped] == [3, 4] and dropped[1]["text"] == text.splitlines()[3][:-24]
    csv_rows = open(os.path.join(out, "metrics.csv")).read().splitlines()
    assert len(csv_rows) == 1 + 4  # header + the same records


@pytest.mark.e2e
def test_plot_skips_a_bad_line_with_a_warning(base_run, tmp_path):
    out = _copy_run(base_run, str(tmp_path / "run"))
    path = os.path.join(out, "metrics.jsonl")
    lines = open(path).read().splitlines(keepends=True)
    lines.insert(2, '{"epoch": 2, "split": "tra\n')
    open(path, "w").writelines(lines)
    proc = check(distribuuuu("plot", out, "--out", str(tmp_path / "plots")))
    assert f"{path} line 3 is not JSON" in proc.stderr
    assert os.path.isfile(tmp_path / "plots" / "learning_curves.png")


def test_the_key_lists_name_real_keys_and_an_unlisted_change_needs_resume_allow():
    from distribuuuu.run_folder import resume_check

    known = set(config.flatten(config.get_defaults()))
    assert resume_check.IDENTITY_KEYS <= known and resume_check.SAFE_KEYS <= known
    assert not resume_check.IDENTITY_KEYS & resume_check.SAFE_KEYS
    old = make_cfg(base=TINY)
    new = make_cfg("OPTIM.WEIGHT_DECAY", "0.001", "TRAIN.WORKERS", "2", base=TINY)
    with pytest.raises(UserError, match=r"OPTIM.WEIGHT_DECAY: 5e-05 -> 0.001   \(changes the recipe"):
        resume_check.compare_configs(old.dump(), new, "last.pth")
    allowed = make_cfg("OPTIM.WEIGHT_DECAY", "0.001", "TRAIN.WORKERS", "2", "TRAIN.RESUME_ALLOW", "['OPTIM.WEIGHT_DECAY']",
                       base=TINY)
    changes = resume_check.compare_configs(old.dump(), allowed, "last.pth")
    assert sorted(changes) == [("OPTIM.WEIGHT_DECAY", 5e-05, 0.001), ("TRAIN.RESUME_ALLOW", [], ["OPTIM.WEIGHT_DECAY"]),
                               ("TRAIN.WORKERS", 0, 2)]
    with pytest.raises(UserError, match="TRAIN.RESUME_ALLOW names 'OPTIM.BASE_RL', which is not a config key"):
        make_cfg("TRAIN.RESUME_ALLOW", "['OPTIM.BASE_RL']", base=TINY)


def test_a_checkpoint_without_data_sizes_past_the_end_of_a_smaller_dataset_is_refused():
    from distribuuuu.run_folder import resume_check

    cfg = make_cfg(base=TINY)
    now = RunFolder.data_identity(300, 50)
    resume_check.check_data({"samples_in_epoch": 288}, now, cfg, "last.pth")  # fits: goes on
    with pytest.raises(UserError, match="has 300 samples now, but the checkpoint is 3328 samples into its epoch"):
        resume_check.check_data({"samples_in_epoch": 3328}, now, cfg, "last.pth")
