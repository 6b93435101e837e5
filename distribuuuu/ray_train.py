"""distribuuuu.train as the training function of Ray Train's
TorchTrainer (the ``ray`` extra: ``pip install distribuuuu[ray]``).

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from distribuuuu import ray_train

    trainer = TorchTrainer(
        ray_train.train_loop,
        train_loop_config={"cfg": "/shared/a.yaml", "opts": ["OUT_DIR", "/shared/runs/a"]},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            storage_path="/shared/ray", failure_config=FailureConfig(max_failures=1)
        ),
    )
    result = trainer.fit()  # .metrics: the last epoch's ("val_top1", ...)

Ray starts one worker per slot, sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, makes the process group (gloo on CPU, nccl
on GPU) and calls the function in a thread of each worker. The run
adopts that group (launch.comm), says ``launcher ray``, and keeps every
guarantee of a torchrun run: the run folder and its lock, auto-resume,
exact evaluation. So OUT_DIR must be on storage every worker sees; after
a failed worker, Ray (FailureConfig) starts the group again and the run
resumes from the folder's last checkpoint, step-exactly. Paths must be
absolute: a Ray worker runs in a folder of Ray's session.

Ray is imported here only, and only once a report is made.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from distribuuuu import api
from distribuuuu.config import load_config
from distribuuuu.engine import HookBase
from distribuuuu.run_folder import LAST

__all__ = ["train_loop", "RayReportHook"]


def train_loop(config: dict[str, Any]) -> None:
    """A TorchTrainer's train_loop_per_worker. config: "cfg" (a YAML
    file), "opts" (KEY VALUE words), "hooks" (HookBase instances).

    TRAIN.PREEMPT_SIGNALS is emptied: signals reach only a process's
    main thread, which is Ray's here; Ray's restart is the recovery.
    """
    os.environ["DISTRIBUUUU_LAUNCHER"] = "ray"  # launch.launcher.detect
    opts = [*config.get("opts", []), "TRAIN.PREEMPT_SIGNALS", "[]"]
    cfg = load_config(config.get("cfg"), opts)
    api.train(cfg, [*config.get("hooks", []), RayReportHook()])


def _numbers(prefix: str, record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers, named "<prefix>_<key>" for Ray."""
    return {
        f"{prefix}_{key}": value
        for key, value in record.items()
        if isinstance(value, (int, float)) and key != "epoch"
    }


class RayReportHook(HookBase):
    """Each epoch's records to Ray (ray.train.report), once per epoch on
    every rank, as Ray requires. Rank 0's report carries a checkpoint
    that only points to the run folder (distribuuuu.json): Ray keeps the
    metrics of its checkpoints, and the run's own checkpoints stay
    where auto-resume finds them."""

    def __init__(self) -> None:
        self.evaluated: dict[str, float] = {}

    def after_eval(self, trainer: Any, split: str, records: list[dict[str, Any]]) -> None:
        if split == "val":  # "test" comes once after the last epoch: no report follows
            for record in records:  # "val", and "val_ema" with TRAIN.EMA
                self.evaluated.update(_numbers(record["split"], record))

    def after_epoch(self, trainer: Any, metrics: dict[str, Any]) -> None:
        import ray.train

        epoch = trainer.state.epoch
        report = {"epoch": epoch, **_numbers("train", metrics), **self.evaluated}
        self.evaluated = {}
        if not trainer.ctx.is_main:
            ray.train.report(report)
            return
        last = os.path.join(trainer.folder.checkpoints, LAST)
        pointer = {"out_dir": trainer.folder.out_dir, "epoch": epoch, "checkpoint": last}
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "distribuuuu.json"), "w") as f:
                json.dump(pointer, f)
            ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(folder))
