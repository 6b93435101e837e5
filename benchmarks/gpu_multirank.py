"""benchmarks/gpu.py's multi-rank jobs (issue #26): 2 ranks sharing one GPU under gloo, against 1 rank.

NCCL refuses two ranks on one GPU; gloo serves them (through host memory, launch/gloo_cuda.py), so on a
one-GPU machine these jobs run every multi-rank code path on CUDA tensors: DDP with device_ids,
gradient bucket views and no_sync accumulation, exact evaluation counters on the device (1 rank and
2 ranks must agree exactly), the step votes, ZeRO-1, FSDP2 (full and sharded checkpoints), SyncBN,
and a stop signal then a resume that must be bitwise the straight run. Each job is registered in
gpu.py (``multirank_jobs``); on the CPU (``--device cpu --small``) the same commands run with gloo on
CPU tensors on config/synthetic_tiny.yaml, which is what tests/test_gpu_paths.py dry-runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

PY = sys.executable
D = [PY, "-m", "distribuuuu"]
TINY = "config/synthetic_tiny.yaml"


def _records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def epochs(a: argparse.Namespace) -> int:
    return 1 if a.small else 2


def base_opts(a: argparse.Namespace) -> list[str]:
    """2 epochs of mnist5k_fast on the GPU (2 ranks x 64 per step); 1 of synthetic_tiny on the CPU."""
    cfg = TINY if a.small else "mnist5k_fast"
    return ["--cfg", cfg, "DEVICE", a.device, "DIST.BACKEND", "gloo", "OPTIM.MAX_EPOCH", str(epochs(a)),
            "NUM_THREADS", "1" if a.small else "2", "TRAIN.AUTO_RESUME", "False"]


def _dist_lines(job: Any) -> list[str]:
    return sorted({ln.strip() for ln in open(os.path.join(job.out, "out.txt")).read().splitlines()
                   if ln.startswith("[dist]") and "/2 " in ln})


def _check_run(job: Any, run: str, res: dict, small: bool) -> None:
    """One 2-rank training run's figures into res; res['problem'] when something is off."""
    recs = _records(os.path.join(job.out, run, "metrics.jsonl"))
    train = [r for r in recs if r.get("split") == "train"]
    val = [r for r in recs if r.get("split") == "val"]
    res[f"{run}_epochs"] = len(train)
    if val:
        res[f"{run}_val_top1"] = round(val[-1]["top1"], 2)
    want = 1 if small else 2
    if len(train) != want or not val or not os.path.isfile(os.path.join(job.out, run, "checkpoints", "last.pth")):
        res["problem"] = f"{run}: not {want} epoch(s), no val record or no last.pth"
    elif not small and val[-1]["top1"] < 50:
        res["problem"] = f"{run}: val top-1 {val[-1]['top1']:.1f} below 50%"


def parse_runs(*runs: str, small: bool = False) -> Callable[[Any], dict]:
    """Parser of a job of 2-rank training runs: each trained 2 epochs; both ranks on one device, gloo."""
    def parse(job: Any) -> dict:
        res: dict[str, Any] = {"dist": _dist_lines(job)}
        for run in runs:
            _check_run(job, run, res, small)
        devices = {ln.split("| device ")[1].split(" |")[0] for ln in res["dist"]}
        if not all("backend gloo" in ln for ln in res["dist"]) or len(devices) != 1:
            res["problem"] = f"the ranks are not gloo on one device: {res['dist']}"
        return res
    return parse


def parse_ddp_eval(small: bool) -> Callable[[Any], dict]:
    """DDP run, then exact eval of its checkpoint with 1 and 2 ranks: the same counts, the same n."""
    def parse(job: Any) -> dict:
        res = parse_runs("run", small=small)(job)
        one, two = (_records(os.path.join(job.out, d, "eval.jsonl")) for d in ("eval1", "eval2"))
        if not one or not two:
            return {**res, "problem": "an eval wrote no eval.jsonl record"}
        one, two = one[-1], two[-1]
        res.update(eval_1rank=[one["top1"], one["topk_acc"], one["n"]], eval_2ranks=[two["top1"], two["topk_acc"], two["n"]],
                   eval_loss_diff=abs(one["loss"] - two["loss"]))
        if (one["top1"], one["topk_acc"], one["n"]) != (two["top1"], two["topk_acc"], two["n"]):
            res["problem"] = "exact eval differs between 1 and 2 ranks"
        return res
    return parse


def parse_resume2(job: Any) -> dict:
    """2 ranks: the straight run vs stopped by a signal and resumed: per-rank losses, epoch metrics and
    final weights bitwise equal."""
    import torch

    s, r = os.path.join(job.out, "straight"), os.path.join(job.out, "resumed")
    key = lambda d: [(m["epoch"], m["split"], m["n"], m["loss"], m["top1"]) for m in _records(  # noqa: E731
        os.path.join(d, "metrics.jsonl"))]
    losses = {d: [open(os.path.join(d, f"loss.rank{k}")).read().split() for k in (0, 1)] for d in (s, r)}
    a, b = (torch.load(os.path.join(d, "checkpoints", "last.pth"), map_location="cpu", weights_only=True)["model"]
            for d in (s, r))
    resumed = re.search(r"resumed from .*, step (\d+),", open(os.path.join(job.out, "out.txt")).read())
    steps = len(losses[s][0])
    res = {"same_epoch_metrics": bool(key(s)) and key(s) == key(r), "same_losses_both_ranks": losses[s] == losses[r],
           "steps_per_rank": steps, "same_final_weights": all(torch.equal(a[k], b[k]) for k in a),
           "resumed_at_step": int(resumed.group(1)) if resumed else None, "dist": _dist_lines(job)}
    if not (res["same_epoch_metrics"] and res["same_losses_both_ranks"] and res["same_final_weights"]):
        res["problem"] = "the resumed 2-rank run differs from the straight one"
    elif not resumed or not 0 < int(resumed.group(1)) < steps:  # the signal must have stopped it mid-run
        res["problem"] = "the signalled run did not stop mid-run and resume"
    return res


def parse_syncbn(small: bool) -> Callable[[Any], dict]:
    def parse(job: Any) -> dict:
        res = parse_runs("run", small=small)(job)
        kept_bn = "keeps per-process BatchNorm" in open(os.path.join(job.out, "out.txt")).read()
        res["syncbn"] = not kept_bn
        if kept_bn and not small:
            res["problem"] = "SyncBatchNorm was not used on the GPU"
        return res
    return parse


def multirank_jobs(a: argparse.Namespace, job: Callable[..., Any]) -> list[Any]:
    """The mr_* jobs; ``job`` is gpu.py's Job class (name, kind, steps, timeout, parse)."""
    base, small = base_opts(a), a.small
    spawn2 = D + ["train", "--nproc-per-node", "2"]
    torchrun2 = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    fault2 = torchrun2 + ["tests/scripts/fault_run.py"]
    uneven = ["TEST.BATCH_SIZE", "16" if small else "96"]  # the last batch of each rank is short
    ckpt = "{out}/run/checkpoints/last.pth"
    det = ["CUDNN.DETERMINISTIC", "True", "CUDNN.BENCHMARK", "False", "TRAIN.AUTO_RESUME", "True",
           "DIST.VOTE_PERIOD_STEPS", "2", "TRAIN.NONFINITE", "skip", "OPTIM.MAX_EPOCH", "2"]
    stop_at = "5" if small else "45"  # mid-epoch 2 of 2 (4 / about 35 steps per epoch), between two votes

    def train2(name: str, *opts: str, head: list[str] = spawn2, parse: Callable | None = None) -> Any:
        return job(name, "correct", [head + base + list(opts) + ["OUT_DIR", "{out}/run"]], 300,
                   parse or parse_runs("run", small=small))

    return [
        job("mr_ddp_eval", "correct", [
            spawn2 + base + ["DIST.GRADIENT_AS_BUCKET_VIEW", "True", "DIST.BUCKET_CAP_MB", "1",
                             "TRAIN.ACCUM_STEPS", "2", *uneven, "OUT_DIR", "{out}/run"],
            D + ["eval"] + base + uneven + ["MODEL.WEIGHTS", ckpt, "OUT_DIR", "{out}/eval1"],
            D + ["eval", "--nproc-per-node", "2"] + base + uneven + ["MODEL.WEIGHTS", ckpt, "OUT_DIR", "{out}/eval2"]],
            420, parse_ddp_eval(small)),
        train2("mr_ddp_torchrun", head=torchrun2 + ["train_net.py"]),
        train2("mr_zero1", "DIST.STRATEGY", "zero1"),
        job("mr_fsdp", "correct", [spawn2 + base + ["DIST.STRATEGY", "fsdp", "OUT_DIR", "{out}/full"],
                                   spawn2 + base + ["DIST.STRATEGY", "fsdp", "DIST.FSDP_STATE_DICT", "sharded",
                                                    "OUT_DIR", "{out}/sharded"]],
            420, parse_runs("full", "sharded", small=small)),
        train2("mr_syncbn", "MODEL.SYNCBN", "True", parse=parse_syncbn(small)),
        job("mr_resume", "correct", [
            (fault2 + base + det + ["OUT_DIR", "{out}/straight"], {"LOSS_LOG": "{out}/straight/loss"}, False),
            (fault2 + base + det + ["OUT_DIR", "{out}/resumed"],
             {"LOSS_LOG": "{out}/resumed/loss", "SIGNAL_AT": f"{stop_at}:1:SIGUSR1"}, True),
            (fault2 + base + det + ["OUT_DIR", "{out}/resumed"], {"LOSS_LOG": "{out}/resumed/loss"}, False)],
            480, parse_resume2),
    ]
