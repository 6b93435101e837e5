"""The recipe from the images under faults (issue 44, item 3) and a sample that makes a BatchNorm
buffer non-finite (item 4): one class is refused naming the folder or the label file; a file the
sampled statistics cannot decode is left out, and none decoding is one line naming the sample; a
144-megapixel JPEG among digit-sized glyphs moves neither the mean/std nor the peak memory; a class
of files with unread extensions names them; an export killed with -9 leaves nothing `train`
takes for the data; a 1e20 sample ends the run at the first checkpoint, naming the buffer.
The refusals run in process (cli_main); the rest are real processes of the installed command, from
a folder outside the checkout (docs/reliability.md has a row for each)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import yaml
from PIL import Image

from tests.conftest import TINY, check, check_user_error, cli_main, env, read_metrics, write_glyph

EXE = shutil.which("distribuuuu", path=os.path.dirname(sys.executable)) or "distribuuuu"


def user_run(cwd, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The installed command, run from cwd (outside the checkout) as a user runs it."""
    e = {k: v for k, v in env().items() if k != "PYTHONPATH"}
    return subprocess.run([EXE, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def glyph_folder(root, classes: int = 4, per_class: int = 15) -> str:
    """root/<class>/<i>.png: 8x8 gray glyphs, digit-sized (60 by default)."""
    for c in range(classes):
        for i in range(per_class):
            write_glyph(str(root / str(c) / f"{i:02d}.png"), (8, 8), seed=100 * c + i)
    return str(root)


# -- one class ------------------------------------------------------------------------------------
def test_one_class_folder_is_refused_naming_it(tmp_path):
    """TRAIN.DATASET one level too deep (a folder holding one class folder), or the other classes
    still copying: exit 2 naming the folder and its one class, no run folder."""
    glyph_folder(tmp_path / "digits", classes=1)
    proc = cli_main("train", "TRAIN.DATASET", str(tmp_path / "digits"), "OUT_DIR", str(tmp_path / "run"))
    check_user_error(proc, f"{tmp_path / 'digits'} holds one class folder, '0'", "2 classes or more",
                     "point TRAIN.DATASET at the folder that holds all the class folders")
    assert not (tmp_path / "run").exists()


def test_a_folder_one_level_above_the_classes_names_the_folder_that_holds_them(tmp_path):
    """TRAIN.DATASET the parent of the folder of class folders: one class, 'digits', whose images
    are every class's; the refusal names the folder to give instead."""
    glyph_folder(tmp_path / "top" / "digits")
    proc = cli_main("train", "TRAIN.DATASET", str(tmp_path / "top"), "OUT_DIR", str(tmp_path / "run"))
    check_user_error(proc, "holds one class folder, 'digits'", "its 4 subfolders (0, 1, 2, 3) look like the classes",
                     f"set TRAIN.DATASET {tmp_path / 'top' / 'digits'}")


def test_a_label_file_of_one_label_is_refused_naming_it(tmp_path):
    """A Kaggle-style images/ + labels.csv whose rows all carry one label."""
    glyph_folder(tmp_path / "kaggle" / "images", classes=1)
    rows = [f"{name[:-4]},three" for name in sorted(os.listdir(tmp_path / "kaggle" / "images" / "0"))]
    for name in os.listdir(tmp_path / "kaggle" / "images" / "0"):
        os.rename(tmp_path / "kaggle" / "images" / "0" / name, tmp_path / "kaggle" / "images" / name)
    (tmp_path / "kaggle" / "labels.csv").write_text("id,label\n" + "\n".join(rows) + "\n")
    labels = tmp_path / "kaggle" / "labels.csv"
    proc = cli_main("train", "TRAIN.DATASET", str(labels), "OUT_DIR", str(tmp_path / "run"))
    check_user_error(proc, f"every row of {labels} has the label 'three'", "2 classes or more",
                     "TRAIN.LABEL_FIELD")


# -- nothing decodes, unread extensions -------------------------------------------------------------
def test_no_sampled_file_decoding_is_exit_2_naming_the_sample_not_nan(tmp_path):
    """Two classes of garbage bytes named .png: the mean/std would be NaN; instead one line naming
    a sampled file and what PIL said, without the repr of an in-memory file."""
    for c in ("a", "b"):
        os.makedirs(tmp_path / "junk" / c)
        for i in range(5):
            (tmp_path / "junk" / c / f"{i}.png").write_bytes(np.random.default_rng(i).bytes(300))
    for command in ("config", "train"):
        proc = cli_main(command, "TRAIN.DATASET", str(tmp_path / "junk"), "OUT_DIR", str(tmp_path / "run"))
        line = check_user_error(proc, "none of the 10 sampled images of", "decodes (first: ",
                                ".png: UnidentifiedImageError: cannot identify image file",
                                "replace them with images that open")
        assert "BytesIO" not in line and "NaN" not in line and "nan" not in line, line
    assert not (tmp_path / "run").exists()


def test_a_class_of_unread_extensions_names_them_and_what_to_do(tmp_path):
    """A class folder holding only GIFs (and a class of .heic, .txt and a README): the refusal
    counts the files by extension and says what would be read."""
    glyph_folder(tmp_path / "data", classes=2)
    shutil.rmtree(tmp_path / "data" / "1")
    os.makedirs(tmp_path / "data" / "1")
    for i in range(20):
        Image.new("L", (8, 8), 10 * i).save(tmp_path / "data" / "1" / f"{i}.gif")
    proc = cli_main("train", "TRAIN.DATASET", str(tmp_path / "data"), "OUT_DIR", str(tmp_path / "run"))
    check_user_error(proc, "1: 20 files with an extension not read here (.gif)",
                     "the extensions read: .bmp, .jpeg, .jpg", "convert them")
    shutil.rmtree(tmp_path / "data" / "1")
    os.makedirs(tmp_path / "data" / "1")
    for name in ("a.heic", "b.heic", "c.txt", "README"):
        (tmp_path / "data" / "1" / name).write_text("x")
    proc = cli_main("train", "TRAIN.DATASET", str(tmp_path / "data"), "OUT_DIR", str(tmp_path / "run"))
    check_user_error(proc, "1: 4 files with an extension not read here (2 .heic, 1 .txt, 1 README)")


# -- a 144-megapixel JPEG among the glyphs --------------------------------------------------------------
# The peak memory of a process and of the ones it waited for (a fresh interpreter runs only the command).
PEAK = textwrap.dedent("""
    import json, resource, subprocess, sys
    proc = subprocess.run(sys.argv[1:])
    print(json.dumps([proc.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))
""")


def _train_peak(cwd, folder: str, out: str) -> tuple[dict, int]:
    """(the config.yaml of a one-epoch run on folder, the run's peak resident memory in KiB)."""
    e = {k: v for k, v in env().items() if k != "PYTHONPATH"}
    argv = [sys.executable, "-c", PEAK, EXE, "train", "TRAIN.DATASET", folder, "OPTIM.MAX_EPOCH", "1",
            "TRAIN.BATCH_SIZE", "8", "OUT_DIR", out]
    proc = subprocess.run(argv, cwd=cwd, env=e, capture_output=True, text=True, timeout=300)
    status, peak = json.loads(proc.stdout.splitlines()[-1])
    assert status == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return yaml.safe_load((cwd / out / "config.yaml").read_text()), peak


def _write_huge_jpeg(path, side: int = 12000) -> None:
    """An RGB JPEG of side x side (144 MP): a gradient with noise that JPEG cannot compress away
    (~25 MB), made from a tiled 400 px noise block (seconds, 432 MB in this process once)."""
    block = np.random.default_rng(0).integers(0, 48, (400, 400, 3), dtype=np.uint8)
    pixels = np.tile(block, (side // 400, side // 400, 1))
    pixels += np.linspace(0, 200, side).astype(np.uint8)[:, None, None]
    Image.fromarray(pixels).save(path, quality=75)


@pytest.mark.e2e
def test_a_144_megapixel_jpeg_moves_neither_the_statistics_nor_the_peak_memory(tmp_path):
    """60 glyphs, then the same with one 12000x12000 JPEG, first in its class (the preflight opens it),
    sampled for the statistics, trained on: TRAIN.MEAN/STD within 0.02 of the glyphs' own (each image
    weighs the same, read at most 128 px), the peak memory within 1.2x (JPEGs decoded at reduced size)."""
    glyphs = glyph_folder(tmp_path / "glyphs")
    shutil.copytree(glyphs, tmp_path / "with_huge")
    _write_huge_jpeg(tmp_path / "with_huge" / "0" / "00.jpg")
    assert os.path.getsize(tmp_path / "with_huge" / "0" / "00.jpg") > 10e6
    plain, plain_peak = _train_peak(tmp_path, "glyphs", "run_glyphs")
    huge, huge_peak = _train_peak(tmp_path, "with_huge", "run_huge")
    for key in ("MEAN", "STD"):
        assert huge["TRAIN"][key] == pytest.approx(plain["TRAIN"][key], abs=0.02), (key, plain, huge)
    assert huge_peak <= 1.2 * plain_peak, (plain_peak, huge_peak)
    print(f"MEAN/STD {plain['TRAIN']['MEAN']}/{plain['TRAIN']['STD']} -> {huge['TRAIN']['MEAN']}/"
          f"{huge['TRAIN']['STD']}; peak {plain_peak / 1024:.0f} -> {huge_peak / 1024:.0f} MiB")


# -- an export killed with -9 ---------------------------------------------------------------------------
def _files_below(folder) -> int:
    return sum(len(files) for _, _, files in os.walk(folder))


@pytest.mark.e2e
def test_an_export_killed_with_sigkill_leaves_nothing_train_takes_and_runs_again(tmp_path):
    """`data export mnist5k DIR` killed with -9 once 500 images are written: no DIR (the export
    writes DIR.partial and renames it when complete); `train` on DIR exits 2 naming the export that
    did not finish; the same export again completes."""
    e = {k: v for k, v in env().items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([EXE, "data", "export", "mnist5k", "mnist"], cwd=tmp_path, env=e,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while _files_below(tmp_path / "mnist.partial") < 500:
            assert proc.poll() is None, "the export ended before it was killed"
            assert time.monotonic() < deadline, "no 500 images written in 120 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (tmp_path / "mnist").exists()
    check_user_error(user_run(tmp_path, "train", "TRAIN.DATASET", "mnist", "OUT_DIR", "run"),
                     "'mnist' itself does not exist", "mnist.partial holds an export that did not complete",
                     "run the export again")
    assert not (tmp_path / "run").exists()
    done = check(user_run(tmp_path, "data", "export", "mnist5k", "mnist"))
    assert "wrote mnist5k to mnist: train 4000, val 1000" in done.stdout
    assert _files_below(tmp_path / "mnist") == 5000 and not (tmp_path / "mnist.partial").exists()


# -- a sample of 1e20 ---------------------------------------------------------------------------------
HUGE_SOURCE = textwrap.dedent('''
    """4 classes of 8x8 ready images (class c bright in quadrant c); training sample 5 is 1e20."""
    import torch

    from distribuuuu.data import register_source


    class Quadrants(torch.utils.data.Dataset):
        def __init__(self, n, seed, huge=()):
            g = torch.Generator().manual_seed(seed)
            self.labels = torch.arange(n) % 4
            self.images = torch.rand(n, 3, 8, 8, generator=g) * 0.4 - 0.5
            for i, c in enumerate(self.labels.tolist()):
                r, k = divmod(c, 2)
                self.images[i, :, 4 * r:4 * r + 4, 4 * k:4 * k + 4] += 0.6
            self.images[list(huge)] = 1e20  # finite: a float32 holds up to 3.4e38
            self.classes = ["a", "b", "c", "d"]

        @property
        def targets(self):
            return self.labels.tolist()

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return self.images[i], int(self.labels[i])


    register_source("huge_sample", lambda split, cfg, key: Quadrants(128, 0, (5,)) if split == "train"
                    else Quadrants(32, 1), stats=((0.0,), (1.0,)))
''')


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_1e20_sample_ends_the_run_at_the_first_checkpoint_naming_the_buffer(tmp_path, nproc):
    """One finite 1e20 sample overflows a BatchNorm running variance while the loss and the gradients
    stay finite: the epoch's checkpoint would hold an inf, so the run ends there, exit 2, one line
    naming the buffer, the step and the epoch, on every rank (was: every epoch trained without a
    checkpoint, exit 3 at the end)."""
    (tmp_path / "huge_sample.py").write_text(HUGE_SOURCE)
    launch = ["--nproc-per-node", "2"] if nproc == 2 else []
    proc = user_run(tmp_path, "train", *launch, "--cfg", TINY, "--import", "huge_sample.py", "TRAIN.DATASET",
                    "huge_sample", "TEST.DATASET", "huge_sample", "TEST.SPLIT", "val", "TRAIN.IM_SIZE", "8",
                    "TEST.IM_SIZE", "8", "OPTIM.MAX_EPOCH", "3", "OUT_DIR", "run")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout and "done:" not in proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]  # each rank's, once
    assert len(errors) == 1, proc.stderr[-3000:]
    line, steps = errors[0], 128 // (16 * nproc)
    for part in (f"the weights are not finite at step {steps} (epoch 1): bn1.running_var (inf)",
                 "check the data for extreme values", "the run ends here"):
        assert part in line, line
    train = [r for r in read_metrics(str(tmp_path / "run")) if r["split"] == "train"]
    assert [r["epoch"] for r in train] == [1], train  # no epoch passed without a checkpoint or a stop
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not os.listdir(checkpoints), line
