"""The CUDA paths (fp16 and its scaler, DataParallel, a GPU per rank, FSDP's offload, TF32, the GPU
benchmark jobs), tested on what a CPU can exercise (docs/performance.md).

No GPU exists here, so where a test needs CUDA's side of a path it says how it stands in for it:
a CPU GradScaler (the same class and update rule as CUDA's), autocast on CPU inside a worker thread,
2 real gloo processes, and patched torch.cuda functions (monkeypatch, only where CUDA itself is what
is missing; the code under test runs unpatched).
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import pytest
import torch
from torch import nn

from tests.conftest import ROOT, TINY, check, distribuuuu, make_cfg, pipeline_name, read_metrics


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 16), nn.ReLU(), nn.Linear(16, 4))


def _fp16_stepper(init_scale: float, *opts: str):
    """A Stepper under TRAIN.AMP fp16 on the CPU, with a CPU GradScaler starting at init_scale."""
    from distribuuuu.optim import Stepper
    from distribuuuu.strategies import Strategy

    cfg = make_cfg("TRAIN.AMP", "fp16", *opts, base=TINY)
    model = _tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = Stepper(cfg, torch.device("cpu"), model, opt, global_batch=16, strategy=Strategy(cfg, None))
    assert stepper.scaler.is_enabled()
    _set_scale(stepper, init_scale)
    return stepper, model


def _set_scale(stepper, init_scale: float) -> None:
    """A fresh CPU GradScaler at init_scale for the stepper and its guard (they share one)."""
    stepper.scaler = stepper.guard.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


# --- item 2: fp16 GradScaler overflow steps are no failures -----------------------------------


@pytest.mark.parametrize("clip", ["0.0", "1.0"])
def test_fp16_overflow_is_a_skipped_step_not_a_failure(clip):
    """A loss scale of 2**100 overflows fp16's backward for real (finite loss, inf gradients): the
    scaler skips the update and halves the scale, and the step is no failure (not a skipped step)."""
    stepper, model = _fp16_stepper(2.0**100, "TRAIN.CLIP_GRAD_NORM", clip, "TRAIN.NONFINITE", "stop")
    before = [p.detach().clone() for p in model.parameters()]
    out = stepper.micro_step(*_batch())
    assert torch.isfinite(out.loss)
    assert out.last and stepper.guard.overflows == 1 and stepper.guard.settle(1) == 0
    assert stepper.scaler.get_scale() == 2.0**99
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # no update was applied
    assert all(p.grad is None for p in model.parameters())
    # A scale that fits: the next step updates the weights, and is no overflow.
    _set_scale(stepper, 2.0**8)
    out = stepper.micro_step(*_batch(1))
    assert out.last and stepper.guard.overflows == 1 and stepper.guard.settle(2) == 0
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_fp16_non_finite_loss_is_a_failure():
    stepper, model = _fp16_stepper(2.0**8)
    x, y = _batch()
    x[0, 0, 0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    out = stepper.micro_step(x, y)
    assert out.last and stepper.guard.overflows == 0 and stepper.guard.settle(1) == 1  # a skipped step
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_fp16_non_finite_loss_in_an_early_micro_batch_is_a_failure():
    """With accumulation the loss check covers every micro-batch of the step, not only the last."""
    stepper, _ = _fp16_stepper(2.0**8, "TRAIN.ACCUM_STEPS", "2")
    x, y = _batch()
    x[0, 0, 0, 0] = float("nan")
    assert not stepper.micro_step(x, y).last
    assert stepper.micro_step(*_batch(1)).last and stepper.guard.settle(1) == 1
    assert not stepper.micro_step(*_batch(2)).last
    assert stepper.micro_step(*_batch(3)).last and stepper.guard.settle(2) == 0  # the flag does not outlive its step


def test_fp16_overflow_below_the_scale_floor_is_a_failure():
    """Gradients that stay infinite (a real hook multiplies one by inf) with a finite loss: an
    overflow while the scale is high, a failure once it is below FP16_MIN_LOSS_SCALE."""
    from distribuuuu.nonfinite import FP16_MIN_LOSS_SCALE

    stepper, model = _fp16_stepper(4 * FP16_MIN_LOSS_SCALE)
    model[1].weight.register_hook(lambda g: g * float("inf"))
    steps = []
    for i in range(3):
        stepper.micro_step(*_batch(i))
        steps.append((stepper.guard.settle(i + 1), stepper.guard.overflows))
    # 4 -> 2 -> 1 (overflows, the scale still at or above the floor), then 0.5: a failure (a skipped step).
    assert steps == [(0, 1), (0, 2), (1, 2)]
    assert stepper.scaler.get_scale() < FP16_MIN_LOSS_SCALE


# --- item 3: dp + bf16: DataParallel's worker threads keep the dtype ---------------------------


def test_dataparallel_replicas_keep_the_amp_dtype_in_worker_threads():
    """torch's parallel_apply runs each replica in a thread under ``autocast(device_type)`` with no
    dtype: on CUDA that is float16 whatever the main thread chose. On this CPU the worker's wrong
    dtype is set explicitly (float16, CUDA autocast's default); the replica wrapper must override it."""
    from distribuuuu.strategies.dp import _AutocastReplica

    assert torch.get_autocast_dtype("cuda") == torch.float16  # what parallel_apply's workers get on a GPU
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    seen = {}

    def worker(name: str, module: nn.Module) -> None:
        with torch.autocast("cpu", dtype=torch.float16):  # parallel_apply's autocast, as on CUDA
            seen[name] = module(x).dtype

    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, module in (("plain", lin), ("wrapped", _AutocastReplica(lin, torch.bfloat16))):
            t = threading.Thread(target=worker, args=(name, module))
            t.start()
            t.join()
    assert seen == {"plain": torch.float16, "wrapped": torch.bfloat16}


def test_autocast_dataparallel_keeps_dataparallel_state_dict_keys():
    from distribuuuu import models
    from distribuuuu.strategies.dp import AutocastDataParallel

    model = _tiny_model()
    wrapped = AutocastDataParallel(model, torch.bfloat16)
    assert list(wrapped.state_dict()) == list(nn.DataParallel(model).state_dict())
    assert models.unwrap(wrapped) is model
    x, _ = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # no GPU: DataParallel calls the module itself
        assert wrapped(x).dtype == torch.bfloat16


# --- items 5 and 8: device choice under Slurm, the CUDA RNG state --------------------------------


def _fake_gpus(monkeypatch, count: int) -> None:
    """torch.cuda reports `count` GPUs (no CUDA exists here to report them for real)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _slurm_info(local_rank: int, local_world: int):
    from distribuuuu.launch.launcher import LaunchInfo

    return LaunchInfo("slurm", local_rank, local_rank, local_world, local_world, 0, "n1", 12345)


def test_slurm_more_tasks_than_gpus_is_a_user_error(monkeypatch):
    from distribuuuu.errors import UserError
    from distribuuuu.launch import comm

    _fake_gpus(monkeypatch, 4)
    monkeypatch.delenv("SLURM_GPUS_PER_TASK", raising=False)
    cfg = make_cfg("DEVICE", "auto", base=TINY)
    with pytest.raises(UserError) as e:  # --ntasks-per-node 8 --gres gpu:4: two ranks per GPU
        comm._choose_device(cfg, _slurm_info(5, 8))
    assert "8 processes on this node but only 4 GPU(s)" in str(e.value)
    assert "--gpus-per-task=1" in str(e.value)
    assert comm._choose_device(cfg, _slurm_info(3, 4)) == torch.device("cuda", 3)  # one per GPU
    _fake_gpus(monkeypatch, 1)  # srun --gpus-per-task=1: each task sees its own GPU as cuda:0
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "1")
    assert comm._choose_device(cfg, _slurm_info(5, 8)) == torch.device("cuda", 0)


@pytest.mark.e2e
def test_cli_exits_2_when_slurm_tasks_outnumber_gpus(tmp_path):
    """The whole command under a Slurm task's environment, with a sitecustomize that makes torch
    report 1 GPU (there is none): exit 2, one message, no traceback, nothing started."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch\ntorch.cuda.is_available = lambda: True\ntorch.cuda.device_count = lambda: 1\n")
    import subprocess
    import sys

    from tests.conftest import ROOT, env

    e = env()
    e.update(PYTHONPATH=f"{site}{os.pathsep}{ROOT}", SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NODEID="0",
             SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2", SLURM_JOB_ID="7",
             SLURM_STEP_NODELIST="localhost")
    e.pop("SLURM_GPUS_PER_TASK", None)
    proc = subprocess.run([sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "DEVICE", "auto",
                           "OUT_DIR", str(tmp_path / "run")], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "2 processes on this node but only 1 GPU(s)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_rng_state_saves_this_gpu_only_and_resumes_with_fewer_gpus(monkeypatch, caplog):
    """A patched CUDA RNG: 8 GPUs whose states are distinct byte strings; this process is on GPU 3."""
    from distribuuuu.engine import rng

    states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(8)}
    restored = {}
    _fake_gpus(monkeypatch, 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[device].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t, device="cuda": restored.update({device: t.clone()}))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda *a: pytest.fail("every GPU's state restored"))
    saved = rng.rng_state()
    assert saved["cuda"] == bytes([3] * 16)  # this process's GPU only
    # Resumed by srun with one GPU per task: the task's GPU is cuda:0.
    _fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    rng.set_rng_state(saved)
    assert list(restored) == [0] and restored[0].tolist() == [3] * 16
    # An older checkpoint holds every visible GPU's state: this GPU's entry, or a warning when none.
    restored.clear()
    old = dict(saved, cuda=[bytes([i] * 16) for i in range(2)])
    rng.set_rng_state(old)
    assert restored[0].tolist() == [0] * 16
    restored.clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    with caplog.at_level("WARNING", logger="distribuuuu"):
        rng.set_rng_state(old)
    assert not restored and "none for GPU 5" in caplog.text


# --- item 7: the in-memory pipeline's budget -----------------------------------------------------


def test_auto_pipeline_falls_back_to_the_loader_above_the_memory_budget(tmp_path, caplog):
    full, subset = tmp_path / "full" / "cifar-10-batches-py", tmp_path / "subset" / "cifar-10-batches-py"
    for folder, per_batch in ((full, 10000), (subset, 100)):
        folder.mkdir(parents=True)
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            with open(folder / name, "wb") as f:  # a sparse file of a real batch's size (pixels only)
                f.truncate(per_batch * 3072)

    def cfg(folder, size: int):
        return make_cfg("TRAIN.DATASET", folder, "TEST.DATASET", folder, "TRAIN.IM_SIZE", size, "MODEL.IN_CHANS", 3,
                        base=TINY)

    assert pipeline_name(cfg(full, 32), "TRAIN") == "memory"  # ~0.4 GB
    with caplog.at_level("WARNING", logger="distribuuuu"):
        assert pipeline_name(cfg(full, 224), "TRAIN") == "loader"  # ~15 GB
    assert "would take 15.6 GB per process" in caplog.text and "DATA_PIPELINE memory forces it" in caplog.text
    assert pipeline_name(cfg(full, 224), "TEST") == "loader"  # 10,000 test images: ~3 GB
    assert pipeline_name(cfg(subset, 224), "TRAIN") == "memory"  # 500 images: ~0.16 GB
    forced = cfg(full, 224)
    forced.defrost()
    forced.TRAIN.DATA_PIPELINE = "memory"
    assert pipeline_name(forced, "TRAIN") == "memory"  # asked for: kept


# --- item 10: bench's synchronizations -----------------------------------------------------------


def test_bench_step_synchronizes_at_the_ends_only_and_bench_data_at_the_end(monkeypatch):
    """bench._synchronize is the one place bench waits for the GPU; counting its calls on the CPU
    shows where a GPU run would wait (the code runs unpatched otherwise)."""
    from distribuuuu.launch import comm
    from distribuuuu.tools import bench

    calls = []
    monkeypatch.setattr(bench, "_synchronize", lambda device: calls.append(time.perf_counter()))
    cfg = make_cfg("TRAIN.DATASET", "mnist5k", "TEST.DATASET", "mnist5k", "MODEL.IN_CHANS", "1",
                   "MODEL.NUM_CLASSES", "10", "TRAIN.IM_SIZE", "28", "TRAIN.BATCH_SIZE", "8", base=TINY)
    with comm.session(cfg) as ctx:
        for iters in (4, 12):
            calls.clear()
            step = bench.bench_step(cfg, ctx, iters=iters, warmup=2)
            assert len(calls) == 3, iters  # start, end of the warm-up, end: not one per step
            assert step["steps"] == iters and step["img_per_s"] > 0
        calls.clear()
        data = bench.bench_data(cfg, ctx, iters=6)
        assert len(calls) == 2  # after the first batch and at the end, before reading the clock
        assert data["batches"] == 6


# --- items 4, 1, 9 with real processes -----------------------------------------------------------


def _replica_worker(out_dir: str) -> None:
    """2 gloo ranks: an FSDP model (with CPU offload), one step, then the evaluation replica."""
    from distribuuuu import models, strategies
    from distribuuuu.launch import comm
    from distribuuuu.optim import Stepper
    from distribuuuu.strategies import fsdp

    cfg = make_cfg("DIST.STRATEGY", "fsdp", "DIST.CPU_OFFLOAD", "True", "TRAIN.CLIP_GRAD_NORM", "1.0", base=TINY)
    with comm.session(cfg) as ctx:
        torch.manual_seed(0)
        strategy = strategies.build(cfg, ctx)
        model = strategy.wrap_model(models.build_model(cfg))
        stepper = Stepper(cfg, ctx.device, model, strategy.build_optimizer(model), global_batch=32, strategy=strategy)
        g = torch.Generator().manual_seed(ctx.rank)
        stepper.micro_step(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
        host = fsdp.host_full_state(model)
        replica = fsdp.EvalReplica(lambda: models.build_model(cfg), ctx.device)
        net = replica.refresh(model)
        same = all(torch.equal(net.state_dict()[k], v) for k, v in host.items())
        replica.release()
        again = replica.refresh(model)  # the second evaluation reuses the host copy
        torch.save({"host": host, "same": same, "reused": again is net,
                    "devices": {str(t.device) for t in host.values()}}, os.path.join(out_dir, f"r{ctx.rank}.pt"))


@pytest.mark.e2e
def test_fsdp_eval_replica_gathers_through_host_memory(tmp_path):
    from distribuuuu.launch import spawn

    assert spawn.spawn(_replica_worker, 2, args=(str(tmp_path),)) == 0
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["same"] and r1["same"] and r0["reused"]
    assert r0["devices"] == {"cpu"}
    assert set(r0["host"]) == set(r1["host"])
    # The whole weights on each rank (BatchNorm statistics follow each rank's batch until the
    # engine averages them before an evaluation).
    params = [k for k in r0["host"] if "running" not in k and "num_batches" not in k]
    assert params and all(torch.equal(r0["host"][k], r1["host"][k]) for k in params)


def test_fsdp_cpu_offload_under_nccl_gets_a_gloo_backend_for_cpu_tensors():
    """The default group's backend: NCCL cannot reduce the CPU tensors of FSDP's CPU offload (the
    clipping norm, the non-finite vote). The run below does those CPU collectives for real (gloo)."""
    from distribuuuu.strategies import strategy_class

    offload = make_cfg("DIST.STRATEGY", "fsdp", "DIST.CPU_OFFLOAD", "True", base=TINY)
    assert strategy_class("fsdp").group_backend(offload, "nccl") == "cpu:gloo,cuda:nccl"
    assert strategy_class("fsdp").group_backend(offload, "gloo") == "gloo"
    fsdp = make_cfg("DIST.STRATEGY", "fsdp", base=TINY)
    assert strategy_class("fsdp").group_backend(fsdp, "nccl") == "nccl"
    assert strategy_class("ddp").group_backend(make_cfg(base=TINY), "nccl") == "nccl"


@pytest.mark.e2e
def test_fsdp_cpu_offload_clipping_and_nonfinite_skip_train_and_evaluate(tmp_path):
    """2 processes, fsdp + CPU offload + clipping + NONFINITE skip, 2 epochs: every evaluation
    refreshes (and then releases) the replica, and counts the whole validation set."""
    out = str(tmp_path / "run")
    check(distribuuuu("train", "--cfg", TINY, "--nproc-per-node", "2", "DIST.STRATEGY", "fsdp",
                      "DIST.CPU_OFFLOAD", "True", "TRAIN.CLIP_GRAD_NORM", "1.0", "TRAIN.SYNTHETIC_SAMPLES", "64",
                      "OUT_DIR", out))
    val = [m for m in read_metrics(out) if m["split"] == "val"]
    assert [m["n"] for m in val] == [50, 50]


def _timeout_worker(out_dir: str) -> None:
    """Rank 0 votes on a gloo side group made with a 3 s timeout; rank 1 does not join for 8 s."""
    from distribuuuu.launch import comm

    with comm.session(make_cfg(base=TINY)) as ctx:
        comm.set_control_group(comm.gloo_side_group(datetime.timedelta(seconds=3)))
        start = time.monotonic()
        if ctx.rank == 0:
            try:
                comm.max_over_ranks([True])
                outcome = "returned"
            except Exception as e:  # noqa: BLE001 - the timeout's exception type is gloo's
                outcome = f"raised {type(e).__name__}"
            with open(os.path.join(out_dir, "r0.txt"), "w") as f:
                f.write(f"{outcome} {time.monotonic() - start:.1f}")
            os._exit(0)  # the group is broken now: leave without a teardown that would wait
        time.sleep(8)
        os._exit(0)


@pytest.mark.e2e
def test_gloo_side_group_uses_the_run_timeout(tmp_path):
    from distribuuuu.launch import spawn

    spawn.spawn(_timeout_worker, 2, args=(str(tmp_path),))
    outcome, seconds = (tmp_path / "r0.txt").read_text().rsplit(" ", 1)
    assert outcome.startswith("raised"), outcome
    assert float(seconds) < 7.5  # the 3 s timeout (not torch's 30 minutes), before rank 1 wakes


@pytest.mark.e2e
def test_a_coarser_vote_acts_on_a_signal_at_the_next_vote_and_resumes_step_exactly(tmp_path):
    """As tests/test_faults.py's step-exact resume, with DIST.VOTE_PERIOD_STEPS 3: SIGUSR1 after
    step 5 is acted on at step 6's vote; the resumed run's losses equal an uninterrupted run's."""
    from tests.test_faults import SMALL, _ckpt, _losses, _run

    vote = ["DIST.VOTE_PERIOD_STEPS", "3", "OPTIM.MAX_EPOCH", "1"]  # one epoch of 8 steps
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    check(_run(SMALL + vote + ["OUT_DIR", straight], {"LOSS_LOG": f"{straight}/loss"}))
    first = _run(SMALL + vote + ["OUT_DIR", stopped], {"LOSS_LOG": f"{stopped}/loss", "SIGNAL_AT": "5:1:SIGUSR1"})
    assert first.returncode != 0, first.stderr[-2000:]  # torchrun: 1 (its ranks: 138 = 128 + SIGUSR1, 143)
    ckpt = _ckpt(stopped)
    assert (ckpt["epoch"], ckpt["global_step"], ckpt["samples_in_epoch"]) == (0, 6, 6 * 32)
    check(_run(SMALL + vote + ["OUT_DIR", stopped], {"LOSS_LOG": f"{stopped}/loss"}))
    for rank in (0, 1):
        assert _losses(f"{stopped}/loss", rank) == _losses(f"{straight}/loss", rank)


def test_vote_period_auto_and_explicit():
    from distribuuuu.engine import vote_period

    assert [vote_period(make_cfg(base=TINY), n) for n in (1, 8, 9, 64)] == [1, 1, 10, 10]
    assert vote_period(make_cfg("DIST.VOTE_PERIOD_STEPS", "4", base=TINY), 64) == 4


# --- item 11: TF32 ---------------------------------------------------------------------------------


def test_tf32_key_sets_the_flags_that_torch_and_its_compiler_read():
    """Both APIs read back consistently: dynamo reads the legacy cuBLAS flag (raises after the new
    setters), inductor the new fp32_precision."""
    from distribuuuu.launch import comm

    try:
        for value, on in (("False", False), ("True", True)):
            comm._set_cuda_flags(make_cfg("CUDNN.TF32", value, base=TINY))
            assert torch._C._get_cublas_allow_tf32() is on  # what torch._dynamo reads
            assert torch.backends.cudnn.allow_tf32 is on
            assert (torch.backends.cuda.matmul.fp32_precision == "tf32") is on  # what inductor reads
            assert (torch.backends.cudnn.conv.fp32_precision == "tf32") is on
    finally:
        comm._set_cuda_flags(make_cfg(base=TINY))


# --- benchmarks/gpu.py: the script that runs these paths on a GPU ---------------------------------


def _gpu_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", os.path.join(ROOT, "benchmarks", "gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_script_runs_every_path_and_its_commands_parse(tmp_path):
    """Every distribuuuu command of benchmarks/gpu.py (the torchrun and fault-injection ones as the
    train command they are) parses and makes a valid config: a typo would cost a GPU session."""
    import argparse

    from tests.test_docs_commands import _parse

    gpu = _gpu_script()
    args = argparse.Namespace(device="cuda", small=False)
    jobs = gpu.all_jobs(args)
    assert {"fp16", "compile", "fsdp_offload_torchrun", "resume", "eval_predict_export", "compare",
            "bench_fp32_no_tf32", "overhead", "memory", "jpeg_io", *JOBS_26} <= {j.name for j in jobs}
    checked = 0
    for job in jobs:
        for step in job.steps:
            cmd = gpu._fill(step[0] if isinstance(step, tuple) else step, str(tmp_path))
            if "distribuuuu" in cmd[:3]:
                words = cmd[cmd.index("distribuuuu") + 1:]
            elif any(s.endswith(("train_net.py", "fault_run.py")) for s in cmd):
                words = ["train", *cmd[next(i for i, s in enumerate(cmd) if s.endswith(".py")) + 1:]]
            else:
                continue
            _parse(" ".join(["distribuuuu", *words]))
            checked += 1
    assert checked >= 30


# Issue #26's jobs: 2 ranks sharing one GPU under gloo, and training from JPEGs (benchmarks/gpu_multirank.py,
# benchmarks/gpu_jpeg.py), with #38's decode on the GPU. On the CPU the same commands run with gloo on CPU
# tensors, tiny, and the GPU decode's device half on the CPU.
JOBS_26 = ("mr_ddp_eval", "mr_ddp_torchrun", "mr_zero1", "mr_fsdp", "mr_syncbn", "mr_resume", "jpeg_e2e",
           "jpeg_decode")


# The jobs whose CPU path another test already runs, with the same kind of launch and the same checks
# (the dry run would only repeat its process starts, about 20 s each); their commands are still parsed
# by test_the_gpu_script_runs_every_path_and_its_commands_parse, and the GPU run keeps them all.
RUN_ELSEWHERE = {
    "mr_ddp_torchrun": "tests/test_launchers.py::test_distribuuuu_readme_command (train_net.py, 2 ranks, a launcher)",
    "mr_syncbn": "tests/test_launchers.py::test_distribuuuu_readme_command (MODEL.SYNCBN True; on the CPU "
                 "per-process BatchNorm, as in this job)",
    "mr_fsdp": "tests/test_fsdp.py's full and sharded checkpoint tests (2 ranks, `distribuuuu train`)",
}
DRY_RUN = tuple(j for j in JOBS_26 if j not in RUN_ELSEWHERE)


@pytest.mark.e2e
def test_the_multirank_and_jpeg_jobs_dry_run_on_the_cpu(tmp_path):
    """`benchmarks/gpu.py --device cpu --small --only <#26's jobs but RUN_ELSEWHERE>`: every job runs
    and passes its own checks (exact eval equal for 1 and 2 ranks, zero1 trains and saves, a signalled
    2-rank run resumed mid-run bitwise, both JPEG sources measured against synthetic with TRAIN.IMAGE_DECODE
    fast and gpu, the decode rates tabled), so the first lent GPU runs them without edits."""
    import json
    import subprocess
    import sys

    from tests.conftest import env

    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--out", str(tmp_path), "--device", "cpu", "--small",
                           "--only", ",".join(DRY_RUN), "--parallel", "2"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "gpu.json") as f:
        jobs = json.load(f)["jobs"]
    assert set(jobs) == set(DRY_RUN) and set(RUN_ELSEWHERE) < set(JOBS_26)
    failed = {name: rec.get("tail", rec.get("result")) for name, rec in jobs.items() if not rec["ok"]}
    assert not failed, failed
    ev = jobs["mr_ddp_eval"]["result"]
    assert ev["eval_1rank"] == ev["eval_2ranks"] and ev["eval_1rank"][2] == 50
    res = jobs["mr_resume"]["result"]
    assert res["same_losses_both_ranks"] and res["same_final_weights"] and 0 < res["resumed_at_step"] < 8
    jpeg, runs = jobs["jpeg_e2e"]["result"], [f"{s} {d}" for s in ("folder", "shards") for d in ("fast", "gpu")]
    assert set(runs) <= set(jpeg) and len(jpeg["verdict"]) == 4
    assert all(0 <= jpeg[r]["data_wait_share"] <= 1 and jpeg[r]["img_per_s"] > 0 for r in runs)
    decode = jobs["jpeg_decode"]["result"]
    assert decode["decoded_on_the_device"] == 48 and decode["gpu_device_half_img_per_s_on_cpu"] > 0


def test_train_epoch_outside_fit_with_the_benchmarks_quiet_metrics(tmp_path, monkeypatch):
    """benchmarks/overhead.py and gpu.py time Trainer.train_epoch without fit: the epoch's last
    iteration is a print step, whose metrics hook needs the writer that fit's before_fit makes
    (it raised AttributeError); quiet_metrics gives it a no-op one."""
    monkeypatch.setenv("DISTRIBUUUU_PROGRESS", "lines")  # overhead.py sets it when unset
    from benchmarks.overhead import _Batches, quiet_metrics
    from distribuuuu import engine
    from distribuuuu.launch import comm

    cfg = make_cfg("OUT_DIR", str(tmp_path), "TRAIN.PRINT_FREQ", "1000", "TRAIN.BATCH_SIZE", "8", base=TINY)
    ctx = comm.setup(cfg)
    try:
        trainer = engine.Trainer(cfg, ctx)
        trainer.build_model(_tiny_model())
        quiet_metrics(trainer)
        trainer.train_epoch(_Batches([_batch(i) for i in range(3)]))
        assert trainer.state.global_step == 3
        assert not os.path.exists(tmp_path / "metrics.jsonl")
    finally:
        comm.teardown()


def test_the_jpeg_job_says_whether_the_target_is_met_and_by_how_much():
    """jpeg_e2e's verdict: met at >= 0.9 of synthetic; else the shortfall, and either the input speed-up
    needed (the steps wait for data) or that the wait is not the cause (the workers load the CPU)."""
    import sys

    sys.path.insert(0, ROOT)
    from benchmarks.gpu_jpeg import verdict

    fig = {"synthetic_img_per_s": 3750, "img_per_s": 3500, "ratio": 0.933, "data_wait_share": 0.02}
    assert verdict("folder", fig) == "folder: 0.93 of synthetic, target 0.9 met"
    fig.update(img_per_s=1875, ratio=0.5, data_wait_share=0.45)
    assert verdict("shards", fig) == ("shards: 0.50 of synthetic, 0.40 short of 0.9: the input must be 1.80x "
                                      "faster (waiting for data 45% of the step time)")
    fig.update(data_wait_share=0.01)
    assert "waiting for data only 1%" in verdict("shards", fig)
