"""Several ranks on one GPU under gloo, on what a CPU can exercise (docs/performance.md).

No GPU exists here: the device choice runs with torch.cuda reporting GPUs (monkeypatch, only where
CUDA itself is missing), and the check of gloo's collectives (launch.gloo_cuda) runs for real on a gloo
group with CPU tensors, a collective gloo really refuses standing in for one it refuses on CUDA.
benchmarks/gpu.py's mr_* jobs run the same paths with 2 ranks on a real GPU.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from distribuuuu import strategies
from distribuuuu.errors import UserError
from distribuuuu.launch import comm, gloo_cuda
from distribuuuu.launch.launcher import LaunchInfo
from tests.conftest import TINY, free_port, make_cfg


def _fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _torchrun_info(local_rank: int, local_world: int) -> LaunchInfo:
    return LaunchInfo("torchrun", local_rank, local_rank, local_world, local_world, 0, "127.0.0.1", 29500)


def test_gloo_lets_ranks_share_a_gpu_round_robin(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    cfg = make_cfg("DEVICE", "cuda", "DIST.BACKEND", "gloo", base=TINY)
    assert [comm._choose_device(cfg, _torchrun_info(r, 2)) for r in (0, 1)] == [torch.device("cuda", 0)] * 2
    _fake_gpus(monkeypatch, 2)
    assert [comm._choose_device(cfg, _torchrun_info(r, 4)).index for r in range(4)] == [0, 1, 0, 1]
    assert comm._choose_backend(cfg, torch.device("cuda", 0)) == "gloo"


@pytest.mark.parametrize("backend", ["auto", "nccl"])
def test_nccl_on_a_shared_gpu_is_refused_naming_gloo(monkeypatch, backend):
    _fake_gpus(monkeypatch, 1)
    cfg = make_cfg("DEVICE", "cuda", "DIST.BACKEND", backend, base=TINY)
    with pytest.raises(UserError) as e:
        comm._choose_device(cfg, _torchrun_info(1, 2))
    msg = str(e.value)
    assert "2 processes on this node but only 1 GPU(s)" in msg and "NCCL refuses" in msg
    assert "DIST.BACKEND gloo" in msg and "\n" not in msg


def _needed(*opts: str) -> list[str]:
    """The collectives the strategy of a config runs on device tensors, as launch.comm asks them."""
    cfg = make_cfg(*opts, base=TINY)
    return strategies.strategy_class(cfg.DIST.STRATEGY).collectives(cfg)


def test_the_collectives_each_config_needs():
    base = ["all_reduce", "broadcast"]
    assert _needed() == base
    assert _needed("DIST.STRATEGY", "zero1") == base
    assert _needed("MODEL.SYNCBN", "True") == base + ["all_gather"]
    fsdp = _needed("DIST.STRATEGY", "fsdp", "DIST.CPU_OFFLOAD", "True")
    assert fsdp == base + ["all_gather_single", "reduce_scatter_single (AVG)"]
    assert set(fsdp) <= set(gloo_cuda.PROBES)


@pytest.fixture
def one_rank_gloo():
    """A real one-rank gloo group in this process (the conftest destroys it if a test fails)."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_every_probe_passes_on_a_real_gloo_group(one_rank_gloo):
    needed = _needed("DIST.STRATEGY", "fsdp", "MODEL.SYNCBN", "True")
    gloo_cuda.check(torch.device("cpu"), needed)  # all five, for real, on CPU tensors
    for name in needed:
        assert gloo_cuda.PROBES[name][0](torch.device("cpu"), 1) is True


def test_a_collective_gloo_refuses_is_one_user_error_line(one_rank_gloo):
    """gloo really refuses PREMUL_SUM (as it would a CPU-only collective on CUDA tensors): the check
    turns that into one line naming the collective, the key that needs it and the way out."""

    def premul(device: torch.device, world: int) -> bool:
        out = torch.empty(2, device=device)
        dist.reduce_scatter_single(out, torch.ones(2 * world, device=device), op=dist._make_nccl_premul_sum(0.5))
        return True

    probes = {"all_reduce": gloo_cuda.PROBES["all_reduce"], "reduce_scatter_single (PREMUL_SUM)":
              (premul, "DIST.STRATEGY fsdp")}
    with pytest.raises(UserError) as e:
        gloo_cuda.check(torch.device("cpu"), [], probes)
    msg = str(e.value)
    assert msg.startswith("DIST.BACKEND gloo cannot run reduce_scatter_single (PREMUL_SUM) on cpu tensors")
    assert "PREMUL_SUM with Gloo" in msg and "which DIST.STRATEGY fsdp needs" in msg
    assert "use DIST.BACKEND nccl with one process per GPU" in msg and "\n" not in msg
    with pytest.raises(UserError, match="returned wrong values for broadcast"):
        gloo_cuda.check(torch.device("cpu"), [], {"broadcast": (lambda d, w: False, "x")})
