"""`distribuuuu bench --io`: the data-loader sweep over loader workers, image folder vs shards, on a
tiny folder of generated JPEGs (16 px, 64 images)."""

import csv
import os
import subprocess
import sys

import pytest

from distribuuuu.data import shards
from distribuuuu.errors import UserError
from distribuuuu.tools import bench_io
from tests.conftest import check, cli_main, env, write_fake_cifar10, write_image_tree

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CLASSES = {"cat": 16, "dog": 16, "eel": 16, "fox": 16}
BATCH = 8


@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("jpegs"))
    write_image_tree(root, "train", CLASSES, ext="jpg", size=(16, 16))
    return root


def _opts(root, *extra):
    return ["TRAIN.DATASET", root, "TRAIN.BATCH_SIZE", str(BATCH), "TRAIN.IM_SIZE", "16", "DEVICE", "cpu",
            "TRAIN.PIN_MEMORY", "False", *extra]


def _read_csv(out):
    with open(os.path.join(out, "io.csv"), newline="") as f:
        return list(csv.DictReader(f))


# ---- the worker list --------------------------------------------------------------------------
@pytest.mark.parametrize("cores", [1, 2, 3, 8, 16])
def test_default_workers_double_up_to_the_cores(cores):
    counts = bench_io.default_workers(cores)
    assert counts[0] == 0 and counts[1] == 1 and counts[-1] <= cores < 2 * counts[-1]
    assert all(b == 2 * a for a, b in zip(counts[1:], counts[2:]))
    assert bench_io.parse_workers(None, cores) == counts


def test_worker_lists_are_parsed_sorted():
    assert bench_io.parse_workers("4,0,2", 2) == [0, 2, 4]
    assert bench_io.parse_workers("3", 2) == [3]


@pytest.mark.parametrize("text", ["0,x", "-1,2", "1,1", "", "1;2"])
def test_bad_worker_lists_are_user_errors(text):
    with pytest.raises(UserError, match="--workers takes a comma-separated list"):
        bench_io.parse_workers(text, 2)


# ---- the table --------------------------------------------------------------------------------
def _row(fmt, workers, rate, per_cpu_s=None):
    return bench_io.IoRow(fmt, workers, rate, rate * 0.9, rate * 1.1, rate / max(workers, 1), per_cpu_s, 0.1, 80, 64)


def test_table_prints_every_row_and_the_shards_to_folder_ratio(capsys):
    rows = [_row("folder", 0, 400.0, 410.0), _row("folder", 2, 900.0, 430.0), _row("shards", 0, 500.0, 520.0),
            _row("shards", 2, 1350.0, 640.0)]
    bench_io.print_table(rows, "header")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "header"
    table = [line.split() for line in lines[2:-2]]
    assert [(t[0], int(t[1]), float(t[2])) for t in table] == [(r.format, r.workers, r.img_per_s) for r in rows]
    assert [float(t[4]) for t in table] == [r.img_per_s_per_worker for r in rows]
    assert [float(t[5]) for t in table] == [r.img_per_cpu_s for r in rows]
    wall, cpu = lines[-2:]
    assert wall.startswith("shards / folder, img/s:") and cpu.startswith("shards / folder, img/CPU-s:")
    assert f"0 workers {500 / 400:.2f}x" in wall and f"2 workers {1350 / 900:.2f}x" in wall
    assert f"0 workers {520 / 410:.2f}x" in cpu and f"2 workers {640 / 430:.2f}x" in cpu


def test_no_ratio_line_for_one_format(capsys):
    bench_io.print_table([_row("shards", 0, 300.0), _row("shards", 1, 250.0)], "header")
    out = capsys.readouterr().out
    assert "shards / folder" not in out
    assert [line.split()[5] for line in out.strip().splitlines()[2:]] == ["-", "-"]  # no CPU time: a dash


# ---- the sweep on a real folder ---------------------------------------------------------------
def test_sweep_writes_table_csv_and_png(jpeg_root, tmp_path):
    out = str(tmp_path / "bench")
    iters, warmup, repeats = 5, 1, 3  # 16 batches: two epochs of 8 batches, read through
    proc = check(cli_main("bench", "--io", "--workers", "0", "--iters", str(iters), "--warmup", str(warmup),
                          "--repeats", str(repeats), "--out", out, *_opts(jpeg_root)))
    formats = ["folder", "shards"]
    rows = _read_csv(out)
    assert [r["format"] for r in rows] == formats and {r["workers"] for r in rows} == {"0"}
    for r in rows:
        assert int(r["images_timed"]) == iters * repeats * BATCH  # full batches, across the epoch boundary
        assert int(r["dataset_images"]) == sum(CLASSES.values())
        rate, low, high = float(r["img_per_s"]), float(r["img_per_s_min"]), float(r["img_per_s_max"])
        assert 0 < low <= rate <= high
        assert float(r["img_per_s_per_worker"]) == pytest.approx(rate)  # 0 workers: the main process
        assert float(r["img_per_cpu_s"]) > 0  # /proc is there on Linux
        assert float(r["first_batch_s"]) > 0
        assert f"{r['format']:<8}{0:>8}{rate:>10.0f}" in proc.stdout  # the table shows what the CSV holds
    assert f"{jpeg_root} ({sum(CLASSES.values())} images)" in proc.stdout
    with open(os.path.join(out, "io.png"), "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert 10_000 < os.path.getsize(os.path.join(out, "io.png")) < 150_000
    assert [e for e in os.listdir(out) if e.startswith("io_shards.")] == []  # the temporary shards are gone


def test_io_shards_are_kept_and_reused(jpeg_root, tmp_path):
    keep, out = str(tmp_path / "keep"), str(tmp_path / "bench")
    args = ("bench", "--io", "--workers", "0", "--iters", "2", "--warmup", "0", "--repeats", "1", "--io-shards", keep,
            "--out", out, *_opts(jpeg_root))
    first = check(cli_main(*args))
    assert "writing shards" in first.stdout
    index = bench_io.find_index(keep, "train")
    assert index is not None and os.path.isfile(index)
    split_dir = os.path.dirname(index)
    tars = sorted(os.path.join(split_dir, n) for n in os.listdir(split_dir) if n.endswith(".tar"))
    before = [os.stat(t).st_mtime_ns for t in tars]
    second = check(cli_main(*args))
    assert "reusing the shards" in second.stdout and "writing shards" not in second.stdout
    assert [os.stat(t).st_mtime_ns for t in tars] == before
    rows = _read_csv(out)
    assert [r["format"] for r in rows] == ["folder", "shards"]
    assert rows[0]["dataset_images"] == rows[1]["dataset_images"]  # the same images in both formats
    # A shard set as TRAIN.DATASET is timed alone.
    alone = str(tmp_path / "alone")
    check(cli_main("bench", "--io", "--workers", "0", "--iters", "2", "--warmup", "0", "--repeats", "1",
                   "--out", alone, *_opts(os.path.dirname(index))))
    assert [r["format"] for r in _read_csv(alone)] == ["shards"]


def test_a_label_file_is_timed_alone_over_its_images(jpeg_root, tmp_path):
    """Label files (and, the same way, a Hugging Face dataset) are image files of another layout: timed
    alone, every listed image read."""
    root = os.path.join(jpeg_root, "train")
    with open(tmp_path / "labels.csv", "w") as f:
        f.write("path,label\n" + "".join(f"{os.path.join(root, c, n)},{c}\n" for c in CLASSES
                                         for n in sorted(os.listdir(os.path.join(root, c)))))
    out = str(tmp_path / "out")
    check(cli_main("bench", "--io", "--workers", "0", "--iters", "2", "--warmup", "0", "--repeats", "1",
                   "--out", out, *_opts(str(tmp_path / "labels.csv"))))
    rows = _read_csv(out)
    assert [r["format"] for r in rows] == ["labels"] and float(rows[0]["img_per_s"]) > 0


def test_stale_io_shards_are_a_user_error(jpeg_root, tmp_path):
    keep = str(tmp_path / "keep")
    small = str(tmp_path / "small")
    write_image_tree(small, "train", {"cat": 3, "dog": 3}, ext="jpg", size=(16, 16))
    shards.write_shards(os.path.join(small, "train"), keep, progress=False)
    bad = check(cli_main("bench", "--io", "--workers", "0", "--iters", "1", "--io-shards", keep,
                         "--out", str(tmp_path / "out"), *_opts(jpeg_root)), 2)
    assert "holds shards of 6 images" in bad.stderr and f"has {sum(CLASSES.values())}" in bad.stderr
    assert "Traceback" not in bad.stderr


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("dataset, expect", [("mnist5k", "the mnist5k source (tensors, no image files)"),
                                             ("synthetic", "the synthetic source (tensors, no image files)"),
                                             ("cifar", "a CIFAR pickle folder")])
def test_sources_without_image_files_exit_2(tmp_path, dataset, expect):
    if dataset == "cifar":
        dataset = str(tmp_path / "cifar")
        write_fake_cifar10(dataset)
    bad = check(cli_main("bench", "--io", "--out", str(tmp_path / "out"), *_opts(dataset)), 2)
    assert expect in bad.stderr and "point TRAIN.DATASET at an image folder" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "out" / "io.csv")


def test_missing_folder_and_dummy_input_exit_2(tmp_path):
    missing = str(tmp_path / "nowhere")
    bad = check(cli_main("bench", "--io", "--out", str(tmp_path / "out"), *_opts(missing)), 2)
    assert f"TRAIN.DATASET is {missing!r}" in bad.stderr and "does not exist" in bad.stderr
    dummy = check(cli_main("bench", "--io", "--out", str(tmp_path / "out"),
                           *_opts(missing, "MODEL.DUMMY_INPUT", "True")), 2)
    assert "MODEL.DUMMY_INPUT makes random tensors" in dummy.stderr


def test_bad_options_exit_2(jpeg_root, tmp_path):
    workers = check(cli_main("bench", "--io", "--workers", "0,two", *_opts(jpeg_root)), 2)
    assert "--workers takes a comma-separated list of loader worker counts" in workers.stderr
    repeats = check(cli_main("bench", "--io", "--repeats", "0", *_opts(jpeg_root)), 2)
    assert "--repeats must be at least 1, got 0" in repeats.stderr
    both = check(cli_main("bench", "--io", "--scaling", "1,2", *_opts(jpeg_root)), 2)
    assert "--scaling and --io are different sweeps; give one of them" in both.stderr
    for proc in (workers, repeats, both):
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# ---- the installed command, from a user's folder ----------------------------------------------
@pytest.mark.e2e
def test_installed_command_sweeps_workers_0_and_1(jpeg_root, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "distribuuuu", "bench", "--io", "--workers", "0,1", "--iters", "3",
                           "--warmup", "1", "--repeats", "2", *_opts(jpeg_root, "OUT_DIR", "run")],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run" / "bench"  # OUT_DIR relative to the user's folder
    rows = _read_csv(str(out))
    formats = ["folder", "shards"]
    assert [(r["format"], int(r["workers"])) for r in rows] == [(f, w) for f in formats for w in (0, 1)]
    assert all(int(r["images_timed"]) == 3 * 2 * BATCH and float(r["img_per_s"]) > 0 for r in rows)
    assert os.path.getsize(out / "io.png") > 10_000
    assert "shards / folder, img/s: 0 workers" in proc.stdout and "1 workers" in proc.stdout


@pytest.mark.e2e
def test_cpu_seconds_count_the_children():
    """A child that has spun for 0.6 CPU-seconds adds them to cpu_seconds while it runs (as a loader
    worker's work counts for the img/CPU-s column)."""
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.6: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while bench_io.cpu_seconds() - time.process_time() < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert bench_io.cpu_seconds() - time.process_time() >= 0.5
    finally:
        child.kill()
        child.wait()
