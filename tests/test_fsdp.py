"""DIST.STRATEGY fsdp (FSDP2 fully_shard), DIST.CPU_OFFLOAD and TRAIN.ACTIVATION_CHECKPOINTING, with 2 real
gloo processes on CPU; its sharded checkpoint write, stopped or failing, in process."""

import os
import sys

import pytest
import torch

from tests.conftest import (
    TINY,
    check,
    cli_main,
    distribuuuu,
    logged,
    make_cfg,
    read_metrics,
    run,
    start_until,
    stop_and_wait,
)

# AdamW keeps two state tensors per parameter: the per-rank share of it is easy to see.
ADAMW = ["OPTIM.OPTIMIZER", "adamw", "OPTIM.BASE_LR", "0.01"]


def _strategy_worker(out_dir):
    """In each of 2 spawned processes: 3 steps (with accumulation 2 and clipping) from the same
    start under ddp, fsdp, fsdp + CPU offload and ddp + activation checkpointing; saves the whole
    weights and the optimizer-state bytes this rank holds. Then the state dict of a sharded model
    with uneven shards, as host_full_state and as DTensor.full_tensor() gather it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import FSDPModule, fully_shard

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
            if isinstance(net, FSDPModule):
                results[f"{name} gathered"] = _gathered_both_ways(net, fsdp, get_model_state_dict)
                results[f"{name} full state"] = _full_state_both_ways(net, opt, fsdp)
        # [5, 3] and [5] are split 3 + 2 rows, [1, 5] and [1] 1 + 0: padded, and an empty shard
        torch.manual_seed(0)
        uneven = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
        whole = {k: v.detach().clone() for k, v in uneven.state_dict().items()}
        fully_shard(uneven)
        results["uneven gathered"] = (whole, *_gathered_both_ways(uneven, fsdp, get_model_state_dict))
    torch.save(results, os.path.join(out_dir, f"rank{ctx.rank}.pt"))


def _gathered_both_ways(net, fsdp, get_model_state_dict) -> tuple[dict, dict]:
    """(host_full_state's eager all-gather, DTensor.full_tensor()'s functional one) of net."""
    functional = {k: getattr(v, "full_tensor", lambda v=v: v)().detach().cpu()
                  for k, v in get_model_state_dict(net).items()}
    return fsdp.host_full_state(net), functional


def _full_state_both_ways(net, opt, fsdp) -> list:
    """(fsdp.full_state's, torch's full_state_dict option's) model and optimizer state, flattened to
    (path, value) pairs: what a full checkpoint holds, gathered eagerly and by DTensor.full_tensor()."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.utils._pytree import keystr, tree_flatten_with_path

    torchs = get_state_dict(net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return [[(keystr(path), leaf) for path, leaf in tree_flatten_with_path(state)[0]]
            for state in (fsdp.full_state(net, opt), torchs)]


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
    # host_full_state (the eager all-gather into one tensor that launch/gloo_cuda.py probes, each
    # shard padded to ceil(rows / world)) gives what DTensor.full_tensor() gives, on every rank
    whole = r0["uneven gathered"][0]
    for r in (r0, r1):
        for name in ("fsdp gathered", "fsdp_offload gathered", "uneven gathered"):
            eager, functional = r[name][-2:]
            assert eager.keys() == functional.keys() and len(eager) >= 4, name
            assert all(torch.equal(eager[k], functional[k]) for k in eager), name
        assert all(torch.equal(r["uneven gathered"][-2][k], whole[k]) for k in whole)
    assert r0["fsdp gathered"][0].keys() == r0["fsdp"][0].keys()
    # A full checkpoint (fsdp.full_state, gathered the same eager way) holds on rank 0 exactly what
    # torch's full_state_dict option gives, model and AdamW state, and nothing on rank 1
    for name in ("fsdp full state", "fsdp_offload full state"):
        mine, torchs = r0[name]
        assert [p for p, _ in mine] == [p for p, _ in torchs] and len(mine) > 20, name
        assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for (_, a), (_, b) in zip(mine, torchs))
        assert r1[name][0] == [], name


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


def _tensors(entry, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a checkpoint's entries (nested dicts and lists), by its path."""
    if torch.is_tensor(entry):
        return {path: entry}
    items = entry.items() if isinstance(entry, dict) else enumerate(entry) if isinstance(entry, list) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{path}/{key}").items()}


MEASURED = ("img_per_s", "time_s", "data_frac", "peak_mem_mb")  # how fast and how big, not what was learnt


@pytest.mark.e2e
def test_a_stopped_fsdp_run_resumes_to_the_straight_run_bit_for_bit_and_evaluates(tmp_path):
    """2 processes, FSDP: SIGTERM in epoch 1 (a step checkpoint, exit 143), then the same command to
    the end. The metrics and every tensor of the final checkpoint (weights, BatchNorm statistics,
    optimizer state, every rank's RNG streams) equal the straight run's. Before: FSDP broadcasts no
    buffers, each rank's running statistics followed its own batches, the step checkpoint kept rank
    0's, and the resumed rank 1 went on from them: every running_mean/var and the val loss differed.
    The checkpoint is a whole state dict, so `distribuuuu eval` reads it like a ddp one."""
    # 512 samples / (2 x 16): 16 steps an epoch at 8 px, a print line every 4: room for a signal
    train = [sys.executable, "-m", "distribuuuu", "train", "--nproc-per-node", "2", "--cfg", TINY, "DIST.STRATEGY",
             "fsdp", "OPTIM.LR_POLICY", "constant", *ADAMW, "TRAIN.SYNTHETIC_SAMPLES", "512",
             "TEST.SYNTHETIC_SAMPLES", "16", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check(run([*train, "OUT_DIR", str(straight)], timeout=300))
    stop_and_wait(*start_until([*train, "OUT_DIR", str(stopped)], stopped, logged("[train] epoch 1/2 iter")))
    ckpt = torch.load(stopped / "checkpoints" / "last.pth", weights_only=True)
    assert ckpt["epoch"] == 0 and ckpt["samples_in_epoch"] > 0, ckpt["samples_in_epoch"]
    assert "resumed from" in check(run([*train, "OUT_DIR", str(stopped)], timeout=300)).stdout
    numbers = [[{k: v for k, v in row.items() if k not in MEASURED} for row in read_metrics(str(out))]
               for out in (straight, stopped)]
    assert numbers[0] == numbers[1] and len(numbers[0]) == 4
    a, b = (_tensors(torch.load(out / "checkpoints" / "last.pth", weights_only=True)) for out in (straight, stopped))
    assert a.keys() == b.keys() and any("running_var" in k for k in a) and any("/optimizer/state/" in k for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    model = [k for k in a if k.startswith("/model/")]
    assert len([k for k in a if k.endswith("/exp_avg")]) == len([k for k in model if "running" not in k
                                                                and "num_batches" not in k])  # keyed by name
    proc = check(distribuuuu("eval", "--checkpoint", f"{straight}/checkpoints/last.pth"))  # the run's own config
    assert f"| loss {numbers[0][-1]['loss']:.4f} | top-1 {numbers[0][-1]['top1']:.2f}%" in proc.stdout  # the same


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
