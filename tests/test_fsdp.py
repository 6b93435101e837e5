"""DIST.STRATEGY fsdp (FSDP2 fully_shard), DIST.CPU_OFFLOAD and TRAIN.ACTIVATION_CHECKPOINTING, with 2 real
gloo processes on CPU; its sharded checkpoint write, stopped or failing, in process."""

import os

import pytest
import torch

from tests.conftest import TINY, check, cli_main, distribuuuu, make_cfg, read_metrics

# AdamW keeps two state tensors per parameter: the per-rank share of it is easy to see.
ADAMW = ["OPTIM.OPTIMIZER", "adamw", "OPTIM.BASE_LR", "0.01"]


def _strategy_worker(out_dir):
    """In each of 2 spawned processes: 3 steps (with accumulation 2 and clipping) from the same
    start under ddp, fsdp, fsdp + CPU offload and ddp + activation checkpointing; saves the whole
    weights and the optimizer-state bytes this rank holds."""
    from torch.distributed.fsdp import FSDPModule

    from distribuuuu import models, strategies
    from distribuuuu.launch import comm
    from distribuuuu.nonfinite import local_tensor
    from distribuuuu.optim import Stepper
    from distribuuuu.strategies import fsdp

    variants = {"ddp": [], "fsdp": ["DIST.STRATEGY", "fsdp"],
                "fsdp_offload": ["DIST.STRATEGY", "fsdp", "DIST.CPU_OFFLOAD", "True",
                                 "DIST.FSDP_RESHARD_AFTER_FORWARD", "False"],
                "ddp_ac": ["TRAIN.ACTIVATION_CHECKPOINTING", "True"]}
    common = [*ADAMW, "TRAIN.ACCUM_STEPS", "2", "TRAIN.CLIP_GRAD_NORM", "0.5"]
    results = {}
    with comm.session(make_cfg(*common, base=TINY)) as ctx:
        for name, opts in variants.items():
            cfg = make_cfg(*common, *opts, base=TINY)
            torch.manual_seed(0)
            strategy = strategies.build(cfg, ctx)
            model = strategy.wrap_model(models.build_model(cfg))
            opt = strategy.build_optimizer(model)
            stepper = Stepper(cfg, ctx.device, model, opt, global_batch=32, strategy=strategy)
            g = torch.Generator().manual_seed(ctx.rank)
            for _ in range(6):  # 3 optimizer steps of 2 micro-batches
                x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
                stepper.micro_step(x, y)
            net = models.unwrap(model)
            weights = fsdp.full_state(net, None)[0] if isinstance(net, FSDPModule) else net.state_dict()
            held = sum(local_tensor(t).numel() * t.element_size() for s in opt.state.values()
                       for t in s.values() if torch.is_tensor(t) and t.dim() > 0)  # this rank's shards only
            results[name] = ({k: v.detach().clone() for k, v in weights.items()}, held)
    torch.save(results, os.path.join(out_dir, f"rank{ctx.rank}.pt"))


@pytest.mark.e2e
def test_fsdp_and_activation_checkpointing_match_ddp_and_fsdp_shards_the_optimizer_state(tmp_path):
    from distribuuuu.launch import spawn

    assert spawn.spawn(_strategy_worker, 2, args=(str(tmp_path),)) == 0
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    ddp_w, ddp_bytes = r0["ddp"]
    start = {k for k in ddp_w}
    for name in ("fsdp", "fsdp_offload", "ddp_ac"):
        weights = r0[name][0]
        assert set(weights) == start, name  # the same keys: checkpoints stay interchangeable
        for k in ddp_w:
            if "running" in k or "num_batches" in k:
                continue  # BatchNorm statistics follow each rank's own batches (and AC recomputes them)
            # The same maths with another order of float sums (reduce-scatter vs all-reduce). AdamW
            # moves every element by about lr (0.01) whatever its gradient's size, so an element
            # whose gradient is near 0 can differ by a rounding-sized fraction of lr: atol 2e-5
            # (0.2% of one step; measured 5e-6 at most); rtol 1e-5 elsewhere.
            torch.testing.assert_close(weights[k], ddp_w[k], rtol=1e-5, atol=2e-5,
                                       msg=lambda m, k=k, name=name: f"{name} {k}: {m}")
    # Under FSDP every parameter is split on dim 0: each rank holds about half of AdamW's state.
    for name in ("fsdp", "fsdp_offload"):
        b0, b1 = r0[name][1], r1[name][1]
        assert b0 + b1 == pytest.approx(ddp_bytes, rel=0.02), name
        assert max(b0, b1) < 0.55 * ddp_bytes, name
    assert r1["ddp"][1] == ddp_bytes  # ddp: the whole state on every rank


def test_activation_checkpointing_keeps_fewer_activations():
    """The bytes autograd saves for the backward pass, counted with saved_tensors_hooks."""
    from distribuuuu import models
    from distribuuuu.strategies import blocks, checkpoint_activations

    def saved_bytes(checkpointing: bool) -> int:
        torch.manual_seed(0)
        model = models.build_model(make_cfg("TRAIN.IM_SIZE", "32", base=TINY))
        if checkpointing:
            assert checkpoint_activations(model, blocks(model)) == 4
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(torch.randn(8, 3, 32, 32)).sum()
        loss.backward()
        return total

    plain, recomputed = saved_bytes(False), saved_bytes(True)
    assert recomputed < 0.5 * plain, (plain, recomputed)


@pytest.mark.e2e
def test_fsdp_full_checkpoint_resumes_exactly_and_evaluates(tmp_path):
    """2 epochs straight vs 1 epoch + resume: the same weights, bit for bit; the checkpoint is a
    whole state dict, so `distribuuuu eval` reads it like a ddp one."""
    # A constant LR: the cosine would depend on MAX_EPOCH, which differs between the runs.
    fsdp = ["--nproc-per-node", "2", "--cfg", TINY, "DIST.STRATEGY", "fsdp", "OPTIM.LR_POLICY", "constant", *ADAMW]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    check(distribuuuu("train", *fsdp, "OUT_DIR", straight))
    check(distribuuuu("train", *fsdp, "OUT_DIR", resumed, "OPTIM.MAX_EPOCH", "1"))
    proc = check(distribuuuu("train", *fsdp, "OUT_DIR", resumed))
    assert "resumed from" in proc.stdout
    a = torch.load(f"{straight}/checkpoints/last.pth", weights_only=True)
    b = torch.load(f"{resumed}/checkpoints/last.pth", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert len(a["optimizer"]["state"]) == len([k for k in a["model"] if "running" not in k and "num_batches" not in k])
    assert read_metrics(straight)[-1]["top1"] == read_metrics(resumed)[-1]["top1"]
    proc = check(distribuuuu("eval", "--cfg", TINY, "MODEL.WEIGHTS", f"{straight}/checkpoints/last.pth",
                             "OUT_DIR", str(tmp_path / "eval")))
    assert f"top-1 {read_metrics(straight)[-1]['top1']:.2f}%" in proc.stdout  # the same exact eval


@pytest.mark.e2e
def test_fsdp_sharded_checkpoint_writes_shards_resumes_and_prunes(tmp_path):
    out = str(tmp_path / "run")
    fsdp = ["--nproc-per-node", "2", "--cfg", TINY, "OUT_DIR", out, "DIST.STRATEGY", "fsdp",
            "DIST.FSDP_STATE_DICT", "sharded", "TRAIN.CKPT_KEEP", "1", *ADAMW]
    check(distribuuuu("train", *fsdp, "OPTIM.MAX_EPOCH", "1"))
    ckpt = torch.load(f"{out}/checkpoints/last.pth", weights_only=True)
    assert ckpt["sharded"] == "epoch_0001.dcp" and "model" not in ckpt
    shards = os.listdir(f"{out}/checkpoints/epoch_0001.dcp")
    assert ".metadata" in shards and len([s for s in shards if s.endswith(".distcp")]) == 2  # one per rank
    proc = check(distribuuuu("train", *fsdp, "OPTIM.MAX_EPOCH", "3"))
    assert "resumed from" in proc.stdout and read_metrics(out)[-1]["epoch"] == 3
    folders = {f for f in os.listdir(f"{out}/checkpoints") if f.endswith(".dcp")}
    # CKPT_KEEP 1: epoch 3's shards, and those best.pth refers to (when an older epoch was best).
    best = torch.load(f"{out}/checkpoints/best.pth", weights_only=True)["sharded"]
    assert folders == {"epoch_0003.dcp", best}
    proc = distribuuuu("eval", "--cfg", TINY, "MODEL.WEIGHTS", f"{out}/checkpoints/last.pth")
    assert proc.returncode == 2 and "dcp_to_torch" in proc.stderr


def test_fsdp_rejects_what_it_cannot_do():
    proc = cli_main("train", "--cfg", TINY, "DIST.STRATEGY", "fsdp", "TRAIN.EMA_DECAY", "0.9")
    assert proc.returncode == 2 and "TRAIN.EMA_DECAY needs whole parameters" in proc.stderr
    proc = cli_main("train", "--cfg", TINY, "DIST.CPU_OFFLOAD", "True")
    assert proc.returncode == 2 and "DIST.CPU_OFFLOAD True needs DIST.STRATEGY fsdp" in proc.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP without a process group
@pytest.mark.parametrize("stop", [KeyboardInterrupt, "Terminated", None])
def test_a_sharded_checkpoint_write_ends_as_a_stop_or_one_clear_error(tmp_path, monkeypatch, stop):
    """torch.distributed.checkpoint collects every failure, a Ctrl-C included, into a
    CheckpointException, a BaseException that the CLI neither reported nor treated as a stop (a raw
    traceback, exit 1). A stop inside its writes (here: in fsync) comes out as the stop; any other
    failure (here: the folder's parent is a file) as an OSError naming the folder."""
    from distribuuuu.launch.signals import Terminated
    from distribuuuu.strategies import fsdp

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # momentum buffers: optimizer state to write
    if stop is None:
        (tmp_path / "a_file").write_text("")
        folder = str(tmp_path / "a_file" / "epoch_0001.dcp")
        with pytest.raises(OSError, match="writing the sharded checkpoint .*epoch_0001.dcp failed"):
            fsdp.save_sharded(model, optimizer, folder)
        return
    stop = Terminated if stop == "Terminated" else stop

    def interrupted_fsync(fd: int) -> None:
        raise stop()

    monkeypatch.setattr(os, "fsync", interrupted_fsync)
    with pytest.raises(stop):
        fsdp.save_sharded(model, optimizer, str(tmp_path / "epoch_0001.dcp"))
    assert not (tmp_path / "epoch_0001.dcp").exists()  # the half-written folder is gone
