"""Every launcher end to end, busy ports, and Distribuuuu's own command (stop signals: test_stop_signals.py).

Real processes only: plain python, the built-in spawner, torchrun and the legacy
torch.distributed.launch, each training config/synthetic_tiny.yaml (gloo on CPU).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import ROOT, TINY, check, env, free_port, read_metrics, run

pytestmark = pytest.mark.e2e  # every test here starts processes

PY = sys.executable
SHORT = ["OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "64"]  # 64 = 2 ranks x 2 batches of 16


def _dist_lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith("[dist] "))


def _weights(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_same_weights(paths) -> None:
    first = _weights(paths[0])
    for path in paths[1:]:
        other = _weights(path)
        assert other.keys() == first.keys()
        for key in first:
            assert torch.equal(first[key], other[key]), f"{path}: {key} differs from {paths[0]}"


# ---------------------------------------------------------------------------------------------
# The launchers, end to end
# ---------------------------------------------------------------------------------------------


def test_plain_python_is_one_process(tmp_path):
    out = tmp_path / "run"
    proc = check(run([PY, "train_net.py", "--cfg", TINY, "OUT_DIR", str(out), *SHORT]))
    assert _dist_lines(proc.stdout) == [
        "[dist] rank 0/1 | local rank 0/1 | node 0 | master - | device cpu | backend - | launcher plain"]
    val = [m for m in read_metrics(out) if m["split"] == "val"]
    assert [m["n"] for m in val] == [50]


# Trains like train_net.py and saves every rank's final weights as OUT_DIR/rank<R>.pt with a hook
# (TRAIN.HOOKS "spawn_dump:DumpWeights": the spawner's children find this file's folder on sys.path);
# the entry point is guarded, as spawn() requires.
SPAWN_DUMP = textwrap.dedent("""
    import os, sys
    import torch
    from distribuuuu import cli, models
    from distribuuuu.engine import HookBase

    class DumpWeights(HookBase):
        def after_fit(self, trainer, summary):
            torch.save(models.state_dict_for_saving(trainer.model),
                       os.path.join(trainer.cfg.OUT_DIR, f"rank{trainer.ctx.rank}.pt"))

    if __name__ == "__main__":
        sys.exit(cli.main(["train", *sys.argv[1:], "TRAIN.HOOKS", "['spawn_dump:DumpWeights']"]))
""")


def test_the_spawner_prints_each_ranks_error_once_and_the_ranks_that_differ(tmp_path, monkeypatch, capsys):
    """Under the spawner a rank leaves its error in the spawner's folder (relay.report_error); the
    spawner prints each distinct message once (relay.spawned_errors): the usual refusal that every
    rank finds together is one line, not one per rank."""
    from distribuuuu.launch import relay

    monkeypatch.setenv(relay.ERROR_DIR_ENV, str(tmp_path))
    for rank, message in [("0", "bad input"), ("1", "bad input"), ("2", "rank 2's own"), ("3", "rank 2's own"),
                          ("10", "bad input")]:
        relay.report_error(message, rank)
    assert capsys.readouterr().err == ""  # nothing printed by the ranks themselves
    assert relay.spawned_errors(str(tmp_path)) == ["error: bad input", "error (ranks 2, 3): rank 2's own"]
    assert os.listdir(tmp_path) == []  # taken away: printed once
    relay.report_error("alone", "1")
    assert relay.spawned_errors(str(tmp_path)) == ["error (rank 1): alone"]
    monkeypatch.setenv(relay.ERROR_DIR_ENV, str(tmp_path / "gone"))  # no folder: the rank prints it
    relay.report_error("still said", "1")
    assert capsys.readouterr().err == "error (rank 1): still said\n"


def test_builtin_spawner_replicas_agree_and_a_busy_port_is_replaced(tmp_path):
    """`--nproc-per-node 2 --master-port P` with P taken: another port is used and logged; replicas agree."""
    script = tmp_path / "spawn_dump.py"
    script.write_text(SPAWN_DUMP)
    out = tmp_path / "run"
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = check(run([PY, str(script), "--nproc-per-node", "2", "--master-port", str(port),
                          "--cfg", TINY, "OUT_DIR", str(out), *SHORT]))
    moved = re.search(rf"\[spawn\] master port {port} is in use; using free port (\d+) instead", proc.stdout)
    assert moved, proc.stdout
    new_port = moved.group(1)
    assert f"[spawn] 2 processes, master 127.0.0.1:{new_port}" in proc.stdout
    assert _dist_lines(proc.stdout) == [
        f"[dist] rank {r}/2 | local rank {r}/2 | node 0 | master 127.0.0.1:{new_port} | device cpu "
        "| backend gloo | launcher spawn" for r in range(2)]
    _assert_same_weights([out / "rank0.pt", out / "rank1.pt"])
    # Rank 0 saved the same model as the checkpoint, and evaluated it on all 50 val samples.
    ckpt = _weights(out / "checkpoints" / "last.pth")
    for key, value in _weights(out / "rank1.pt").items():
        assert torch.equal(ckpt["model"][key], value), key
    assert [m["n"] for m in read_metrics(out) if m["split"] == "val"] == [50]


def test_legacy_launch_passes_local_rank(tmp_path):
    """`python -m torch.distributed.launch` appends --local-rank=N to the script's arguments."""
    out = tmp_path / "run"
    proc = check(run([PY, "-m", "torch.distributed.launch", "--nproc_per_node=2",
                      f"--master_port={free_port()}", "train_net.py", "--cfg", TINY, "OUT_DIR", str(out),
                      *SHORT]))
    lines = _dist_lines(proc.stdout)
    assert [line.split(" | ")[:2] for line in lines] == [
        ["[dist] rank 0/2", "local rank 0/2"], ["[dist] rank 1/2", "local rank 1/2"]]
    assert all(line.endswith("| backend gloo | launcher launch") for line in lines), lines
    assert [m["n"] for m in read_metrics(out) if m["split"] == "val"] == [50]
    assert os.path.isfile(out / "checkpoints" / "last.pth")


# ---------------------------------------------------------------------------------------------
# A master port that is already taken
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def busy_port():
    """A port some other program listens on."""
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_busy_master_port_with_env_launch_is_a_user_error(tmp_path, busy_port):
    """Variables set by hand (or any launcher whose rank 0 hosts the store): exit 2, the port named."""
    e = env()
    e.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(busy_port))
    proc = subprocess.run([PY, "train_net.py", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run")], cwd=ROOT,
                          env=e, capture_output=True, text=True, timeout=120)
    check(proc, 2)
    assert proc.stderr.strip() == (f"error: master port {busy_port} on 127.0.0.1 is already in use; "
                                   "pick another with MASTER_PORT=... or --master-port ...")


def test_busy_master_port_under_torchrun_is_named(tmp_path, busy_port):
    """torchrun's agent binds the port itself, before our code runs: its own error names the port."""
    proc = run([PY, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={busy_port}", "train_net.py", "--cfg", TINY,
                "OUT_DIR", str(tmp_path / "run")], timeout=120)
    assert proc.returncode != 0
    assert f"port: {busy_port}" in proc.stderr and "EADDRINUSE" in proc.stderr, proc.stderr[-3000:]
    assert "[dist]" not in proc.stdout  # no worker started


def test_master_port_without_spawner_is_refused(tmp_path):
    proc = check(run([PY, "train_net.py", "--master-port", "29500", "--cfg", TINY]), 2)
    assert proc.stderr.startswith("error: --master-port goes with --nproc-per-node")


# ---------------------------------------------------------------------------------------------
# Distribuuuu's command, as its README writes it
# ---------------------------------------------------------------------------------------------


def _image_folder(root, classes: int, per_class: dict[str, int]) -> None:
    """A small ImageFolder tree of 32x32 PNGs: one colour per class plus noise (learnable)."""
    rng = np.random.default_rng(0)
    for split, n in per_class.items():
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            colour = np.array([(37 * c) % 256, (91 * c) % 256, (255 - 23 * c) % 256])
            for i in range(n):
                pixels = np.clip(colour + rng.integers(-40, 41, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:04d}.png")


def test_distribuuuu_readme_command(tmp_path):
    """`python -m torch.distributed.launch ... train_net.py --cfg config/resnet18.yaml OUT_DIR ...
    MODEL.SYNCBN True TRAIN.BATCH_SIZE 256` unchanged; only overrides that make it a CPU-sized run."""
    data = tmp_path / "data"
    # 2 ranks x 256 = 512 images per step: 1040 training images give 2 steps per epoch.
    _image_folder(data, classes=10, per_class={"train": 104, "val": 10})
    out = tmp_path / "r18"
    proc = check(run([
        PY, "-m", "torch.distributed.launch", "--nproc_per_node=2", "--nnodes=1", "--node_rank=0",
        "--master_addr=localhost", f"--master_port={free_port()}",
        "train_net.py", "--cfg", "config/resnet18.yaml", "OUT_DIR", str(out),
        "MODEL.SYNCBN", "True", "TRAIN.BATCH_SIZE", "256",
        # CPU-sized: a tiny ResNet, the local folder, small images, one epoch, no loader workers.
        "MODEL.ARCH", "resnet_tiny", "TRAIN.DATASET", str(data), "TEST.DATASET", str(data),
        "MODEL.NUM_CLASSES", "10", "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "36", "OPTIM.MAX_EPOCH", "1",
        "TRAIN.WORKERS", "0", "DEVICE", "cpu", "NUM_THREADS", "1",
    ], timeout=300))
    assert [line.split(" | ")[0] for line in _dist_lines(proc.stdout)] == ["[dist] rank 0/2", "[dist] rank 1/2"]
    assert "launcher launch" in proc.stdout
    assert re.search(r"batch 256 per process\b.* 512 global", proc.stdout), proc.stdout[-3000:]
    lines = read_metrics(out)
    train = [m for m in lines if m["split"] == "train"]
    val = [m for m in lines if m["split"] == "val"]
    assert [m["n"] for m in train] == [1024]  # 2 full global batches (the rest is dropped)
    assert [m["n"] for m in val] == [100]  # exact: every val image once
    ckpt = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["cfg"]
