"""Two nodes for real: two network namespaces joined by a veth pair, torchrun on each, world size 4.

Each namespace has its own network stack (interfaces, addresses, ports, loopback), so the two
torchrun agents and their workers can only meet over the veth link, as two hosts meet over a
cable. Creating namespaces needs root and iproute2 (`ip`); CI has both. Also Distribuuuu's
"one node, two tasks": two launcher groups with --nnodes=2 on one host, over loopback.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass

import pytest
import torch

from distribuuuu.run_folder.metrics_files import read_jsonl
from tests.conftest import ROOT, TINY, check, distribuuuu, env, read_metrics

pytestmark = pytest.mark.e2e  # every test here starts processes

PY = sys.executable
SUBNET = "10.123.0"  # private addresses of our own choosing, only inside the namespaces
SHORT = ["OPTIM.MAX_EPOCH", "1"]  # 128 training samples: 2 steps of 4 ranks x 16


@dataclass(frozen=True)
class Host:
    netns: str  # the namespace: this "host"
    ifname: str  # its end of the veth cable
    addr: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _remove_netns(name: str) -> None:
    """Kill what still runs inside, then delete the namespace (its veth end goes with it)."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except OSError:
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture(scope="module")
def two_hosts(request) -> list[Host]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        reason = ("network namespaces need root and iproute2's `ip`: "
                  f"running as uid {os.geteuid()}, ip {'found' if shutil.which('ip') else 'not found'}")
        print(f"SKIP two-host tests: {reason}", file=sys.stderr)
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]  # unique per session: parallel runs get their own namespaces
    hosts = [Host(f"du{tag}n{i}", f"du{tag}v{i}", f"{SUBNET}.{i + 1}") for i in range(2)]
    for host in hosts:
        request.addfinalizer(lambda name=host.netns: _remove_netns(name))  # even if a step below fails
    for host in hosts:
        _ip("netns", "add", host.netns)
    _ip("link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)
    for host in hosts:
        _ip("link", "set", host.ifname, "netns", host.netns)
        _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
        _ip("-n", host.netns, "link", "set", host.ifname, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
    return hosts


def _on_hosts(hosts: list[Host], node_args, tmp_path, timeout: float = 240) -> list[str]:
    """Start torchrun (2 workers of train_and_dump.py) in every namespace at once; return the outputs."""
    out = str(tmp_path / "run")
    procs, logs = [], []
    for node, host in enumerate(hosts):
        e = env()
        e["GLOO_SOCKET_IFNAME"] = host.ifname  # gloo would use the address the hostname resolves to
        log_path = tmp_path / f"node{node}.txt"
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", host.netns, PY, "-m", "torch.distributed.run", "--nnodes=2",
                 "--nproc-per-node=2", *node_args(node, host), "tests/scripts/train_and_dump.py",
                 "--cfg", TINY, "OUT_DIR", out, *SHORT],
                cwd=ROOT, env=e, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log_path)
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    texts = [p.read_text() for p in logs]
    for node, (proc, text) in enumerate(zip(procs, texts)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{text[-5000:]}"
    return texts


def _dist_lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith("[dist] "))


def _assert_replicas_identical(out, world: int) -> None:
    weights = [torch.load(out / f"rank{r}.pt", map_location="cpu", weights_only=True) for r in range(world)]
    for r in range(1, world):
        assert weights[r].keys() == weights[0].keys()
        for key in weights[0]:
            assert torch.equal(weights[r][key], weights[0][key]), f"rank {r}: {key} differs from rank 0"


def _assert_eval_matches_one_process(out, tmp_path) -> None:
    """The 4-rank val line of the run equals a single-process eval of its saved checkpoint."""
    (val,) = [m for m in read_metrics(out) if m["split"] == "val"]
    assert val["n"] == 50  # 50 val samples over 4 ranks: exact, though 50 is not a multiple of 4
    single = tmp_path / "eval1"
    check(distribuuuu("eval", "--cfg", TINY, "OUT_DIR", str(single),
                      "MODEL.WEIGHTS", str(out / "checkpoints" / "last.pth")))
    one = read_jsonl(os.path.join(single, "eval.jsonl"))[-1]  # eval's record file
    assert (one["top1"], one["topk_acc"], one["n"]) == (val["top1"], val["topk_acc"], val["n"])


def test_two_hosts_static_rendezvous(two_hosts, tmp_path):
    """--master-addr/--master-port (the static rendezvous): node ranks as given."""
    master = two_hosts[0].addr
    texts = _on_hosts(two_hosts, lambda node, host: [f"--node-rank={node}", f"--master-addr={master}",
                                                     "--master-port=29500"], tmp_path)
    for node, text in enumerate(texts):
        assert _dist_lines(text) == [
            f"[dist] rank {2 * node + r}/4 | local rank {r}/2 | node {node} | master {master}:29500 "
            "| device cpu | backend gloo | launcher torchrun" for r in range(2)], text[-3000:]
    out = tmp_path / "run"
    _assert_replicas_identical(out, 4)
    _assert_eval_matches_one_process(out, tmp_path)


def test_two_hosts_c10d_rendezvous(two_hosts, tmp_path):
    """--rdzv-backend=c10d: the agents agree on node ranks themselves.

    Node 0's agent hosts the rendezvous store. torchrun decides that by matching the endpoint
    against the machine's hostname, which misses addresses of secondary interfaces such as our
    veth: is_host=1 says it. --local-addr gives the address the other node must use for this one
    (by default the hostname, which resolves to a loopback address here).
    """
    endpoint = f"{two_hosts[0].addr}:29400"
    rdzv_id = f"test-{uuid.uuid4().hex[:8]}"

    def node_args(node: int, host: Host) -> list[str]:
        args = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}",
                f"--local-addr={host.addr}"]
        return args + (["--rdzv-conf=is_host=1"] if node == 0 else [])

    texts = _on_hosts(two_hosts, node_args, tmp_path)
    lines = _dist_lines("\n".join(texts))
    assert [line.split(" | ")[0] for line in lines] == [f"[dist] rank {r}/4" for r in range(4)], lines
    for text in texts:  # each namespace holds one whole node: local ranks 0 and 1 of one node rank
        local = _dist_lines(text)
        assert [line.split(" | ")[1] for line in local] == ["local rank 0/2", "local rank 1/2"], local
        assert len({line.split(" | ")[2] for line in local}) == 1, local
    assert all(line.endswith("| device cpu | backend gloo | launcher torchrun") for line in lines), lines
    out = tmp_path / "run"
    _assert_replicas_identical(out, 4)
    assert [m["n"] for m in read_metrics(out) if m["split"] == "val"] == [50]


def test_one_host_two_launcher_groups(tmp_path):
    """Distribuuuu's "1 node, 2 tasks": two `torch.distributed.launch --nnodes=2` groups on one host,
    node_rank 0 and 1, master localhost (with GPUs each group gets its own CUDA_VISIBLE_DEVICES)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    procs, logs = [], []
    for node in range(2):
        log_path = tmp_path / f"task{node}.txt"
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen(
                [PY, "-m", "torch.distributed.launch", "--nproc_per_node=2", "--nnodes=2", f"--node_rank={node}",
                 "--master_addr=localhost", f"--master_port={port}", "tests/scripts/train_and_dump.py",
                 "--cfg", TINY, "OUT_DIR", str(out), *SHORT],
                cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT))
        logs.append(log_path)
    try:
        for proc in procs:
            proc.wait(timeout=240)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for node, (proc, log_path) in enumerate(zip(procs, logs)):
        text = log_path.read_text()
        assert proc.returncode == 0, f"task {node} exited {proc.returncode}:\n{text[-5000:]}"
        assert _dist_lines(text) == [
            f"[dist] rank {2 * node + r}/4 | local rank {r}/2 | node {node} | master localhost:{port} "
            "| device cpu | backend gloo | launcher launch" for r in range(2)], text[-3000:]
    _assert_replicas_identical(out, 4)
    assert [m["n"] for m in read_metrics(out) if m["split"] == "val"] == [50]
