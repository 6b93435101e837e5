"""The tutorial ladder (tutorial/*.py): every step runs a few real steps under its own launcher.

Each run trains for 3 steps of 1 epoch on the mnist5k digits (or their ImageFolder export) and
must: exit 0; print the step line exactly once (so only rank 0 prints it); print the batch-size
line once with global = per process x world size; and end with `val acc: ...% (n=1000)`, the
all-reduced count of distinct val samples. (1,000 / 2 needs no padding, so the exactness of that
count for world sizes that do not divide the set is checked on evaluate() itself, below.)
The Slurm step (mnmc_ddp_slurm.py) is tested in tests/test_slurm.py, with every test that uses the
local cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, check, free_port, run

PY = sys.executable
TUTORIAL = os.path.join(ROOT, "tutorial")
PER_PROCESS = 16
ARGS = ["--epochs", "1", "--max-steps", "3", "--batch-size", str(PER_PROCESS)]

STEP_RE = re.compile(r"== step: \[\s*(\d+)/\s*(\d+)\] \[(\d+)/(\d+)\] \| loss: \d+\.\d{3} \| acc: +\d+\.\d{3}%")
BATCH_RE = re.compile(r"batch size: (\d+) per process x (\d+) process(?:es)? = (\d+) global")
VAL_RE = re.compile(r"val acc: (\d+\.\d\d)% \(n=(\d+)\)")
INIT_RE = re.compile(r"\[init\] == rank: (\d+), local rank: (\d+), world size: (\d+)")


def script(name: str) -> str:
    return os.path.join(TUTORIAL, name)


def read_lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def torchrun_cmd() -> list[str]:
    """The torchrun next to this Python (the venv's), else the same entry point as a module."""
    exe = os.path.join(os.path.dirname(PY), "torchrun")
    return [exe] if os.access(exe, os.X_OK) else [PY, "-m", "torch.distributed.run"]


def check_ladder_output(proc: subprocess.CompletedProcess, world: int) -> str:
    """The assertions every step shares; returns stdout."""
    check(proc)
    out = proc.stdout
    report = f"\n--- stdout\n{out[-3000:]}\n--- stderr\n{proc.stderr[-2000:]}"
    # 3 steps < PRINT_FREQ: one line for the last step, and only from rank 0.
    assert STEP_RE.findall(out) == [("3", "3", "1", "1")], f"expected one step line [3/3] [1/1]{report}"
    batch = BATCH_RE.findall(out)
    assert len(batch) == 1, f"expected one batch-size line{report}"
    per, nproc, global_batch = map(int, batch[0])
    assert (per, nproc, global_batch) == (PER_PROCESS, world, PER_PROCESS * world), report
    val = VAL_RE.findall(out)
    assert len(val) == 1 and val[0][1] == "1000", f"expected one `val acc: ..% (n=1000)` line{report}"
    if world > 1:
        inits = sorted((int(r), int(w)) for r, _, w in INIT_RE.findall(out))
        assert inits == [(r, world) for r in range(world)], f"every rank reports its place once{report}"
    return out


@pytest.mark.e2e
def test_snsc():
    check_ladder_output(run([PY, script("snsc.py"), *ARGS]), world=1)


@pytest.mark.e2e
def test_snmc_dp():
    # No GPU here: DataParallel is the module itself, and the script behaves like snsc.py.
    check_ladder_output(run([PY, script("snmc_dp.py"), *ARGS]), world=1)


@pytest.mark.e2e
def test_mnmc_ddp_launch_torchrun():
    cmd = [*torchrun_cmd(), "--standalone", "--nproc-per-node", "2", script("mnmc_ddp_launch.py"), *ARGS]
    check_ladder_output(run(cmd), world=2)


@pytest.mark.e2e
def test_mnmc_ddp_launch_legacy_launcher():
    # torch.distributed.launch appends --local-rank=N to the script's arguments.
    cmd = [PY, "-m", "torch.distributed.launch", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), script("mnmc_ddp_launch.py"), *ARGS]
    check_ladder_output(run(cmd), world=2)


@pytest.mark.e2e
def test_mnmc_ddp_mp():
    cmd = [PY, script("mnmc_ddp_mp.py"), "--nodes", "1", "--ngpus_per_node", "2", "--node_rank", "0",
           "--dist-url", f"tcp://127.0.0.1:{free_port()}", *ARGS]
    check_ladder_output(run(cmd), world=2)


@pytest.fixture(scope="session")
def mnist5k_tree(tmp_path_factory) -> str:
    """The mnist5k digits as an ImageFolder tree, exported once per test session.

    The function behind `distribuuuu data export mnist5k DIR`, called in this process: a
    subprocess would spend seconds of CPU importing torch again for a few seconds of PNG writing.
    """
    from distribuuuu.data.sources.export import mnist5k as export_mnist5k

    root = str(tmp_path_factory.mktemp("tutorial") / "mnist5k")
    assert export_mnist5k(root) == {"train": 4000, "val": 1000}
    return root


@pytest.mark.e2e
def test_imagenet_torchrun(mnist5k_tree, tmp_path):
    ckpt = str(tmp_path / "checkpoint.pth")
    cmd = [*torchrun_cmd(), "--standalone", "--nproc-per-node", "2", script("imagenet.py"),
           "--data", mnist5k_tree, "--im-size", "28", "--workers", "0", "--ckpt", ckpt, *ARGS]
    out = check_ladder_output(run(cmd), world=2)
    # Rank 0 saved the checkpoint; after the barrier EVERY rank loaded it and found its own weights.
    loaded = re.findall(r"\[ckpt\] rank (\d+): loaded (\S+) \(epoch 1\) on cpu, weights equal this rank's model", out)
    assert sorted(loaded) == [("0", ckpt), ("1", ckpt)], out
    assert os.path.exists(ckpt) and not os.path.exists(ckpt + ".tmp")


@pytest.mark.e2e
def test_bad_data_folder_exits_2_before_any_process_group(tmp_path):
    """A wrong --data is reported (exit 2, one message, no traceback) before the launcher check."""
    proc = run([PY, script("imagenet.py"), "--data", str(tmp_path)], timeout=120)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert f"{tmp_path}/train is not a folder" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_scripts_are_standalone_and_shard_the_training_set():
    """No framework imports; shuffle=True on one process, DistributedSampler + set_epoch under DDP."""
    for name in ("snsc.py", "snmc_dp.py", "mnmc_ddp_launch.py", "mnmc_ddp_mp.py", "mnmc_ddp_slurm.py", "imagenet.py"):
        source = "\n".join(read_lines(script(name)))
        assert not re.search(r"^\s*(import|from)\s+distribuuuu", source, re.M), name
        if name.startswith("sn"):
            assert "shuffle=True" in source and "DistributedSampler" not in source, name
        else:
            assert "sampler=train_sampler" in source and "train_sampler.set_epoch(ep)" in source, name


def load_script(name: str):
    """Import a tutorial script as a module (it only defines functions; main() runs under __main__)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"tutorial_{name[:-3]}", script(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_host_of_slurm_hostlists():
    module = load_script("mnmc_ddp_slurm.py")
    cases = {"vm": "vm", "node1,node2": "node1", "gpu[03-05,9],cpu1": "gpu03", "n[7]": "n7",
             "a-b.c[007-010]": "a-b.c007"}
    for nodelist, first in cases.items():
        assert module.first_host(nodelist) == first, nodelist
    if shutil.which("scontrol"):  # a form the pattern leaves to `scontrol show hostnames`
        assert module.first_host("r[1-2]n[3-4]") == "r1n3"


def test_val_shards_count_every_sample_once_for_any_world_size():
    """The DDP steps' evaluate(), called as each rank of W processes in turn, for W that do not
    divide the val set: the counts add up to one evaluation of the whole set (a DistributedSampler
    would count 2 samples twice for W = 3). The two-process runs above cannot show this: 1,000 / 2
    needs no padding. A one-process gloo group makes all_reduce the identity here."""
    import torch
    import torch.distributed as dist

    module = load_script("mnmc_ddp_launch.py")
    torch.manual_seed(0)
    valset = torch.utils.data.TensorDataset(torch.randn(101, 1, 28, 28), torch.randint(0, 10, (101,)))
    model, cpu = module.build_net("small", 1, 10), torch.device("cpu")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        whole = module.evaluate(model, valset, cpu, 16, 0, 1)
        assert whole[1] == 101
        for world in (2, 3, 7):
            parts = [module.evaluate(model, valset, cpu, 16, rank, world) for rank in range(world)]
            assert [sum(c for c, _ in parts), sum(n for _, n in parts)] == whole, (world, parts)
    finally:
        dist.destroy_process_group()


def test_readme_diff_excerpts_match_the_scripts():
    """Every ```diff block in tutorial/README.md is part of `diff -u` of the pair named before it."""
    import difflib

    lines = read_lines(os.path.join(TUTORIAL, "README.md"))
    pair, block, checked = None, None, 0
    for line in lines:
        marker = re.fullmatch(r"<!-- diff: (\S+) (\S+) -->", line.strip())
        if marker:
            pair = marker.groups()
        elif line.startswith("```diff"):
            assert pair, "a ```diff block before any <!-- diff: A B --> marker"
            block = []
        elif line.startswith("```") and block is not None:
            old, new = (read_lines(script(name)) for name in pair)
            real = set(difflib.unified_diff(old, new, lineterm="", n=0))
            for excerpt in block:
                if excerpt[:1] in "+-":
                    assert excerpt in real, f"README excerpt line not in diff -u {pair[0]} {pair[1]}: {excerpt!r}"
                else:  # context: unchanged, so in both files
                    assert excerpt[1:] in old and excerpt[1:] in new, f"context not in {pair}: {excerpt!r}"
            block, checked = None, checked + 1
        elif block is not None:
            block.append(line)
    assert checked >= 8, f"only {checked} diff excerpts found"
