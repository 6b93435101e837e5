"""The public Python API: train, evaluate, and load a trained model
without the CLI.

    from distribuuuu import api, config

    cfg = config.load_config("config/synthetic_tiny.yaml", ["OUT_DIR", "runs/api"])
    summary = api.train(cfg)            # what `distribuuuu train` runs, in this process
    record = api.evaluate(cfg)          # what `distribuuuu eval` runs (OUT_DIR's best.pth)
    loaded = api.load_model("runs/api/checkpoints/best.pth")
    loaded.model, loaded.transform, loaded.classes   # the model in eval mode, its inputs, classes

``cfg`` is a yacs CfgNode from ``config.load_config(cfg_file, opts)``
(validated, frozen, the IMPORTS modules imported); a path to a YAML file
is accepted as a shorthand for ``config.load_config(path)``. ``train``
and ``evaluate`` run in the calling process under any launcher: plain
python (one process), or a process that torchrun / srun / the spawner
started (each rank calls them; launcher.launcher.detect tells them
apart). They take the same run-folder lock and make the same checks as
the CLI, which calls the same ``run_command``. A user error raises
``distribuuuu.errors.UserError`` instead of exiting with status 2; a
preemption signal raises ``distribuuuu.launch.signals.Preempted`` after
the step checkpoint (and the Slurm requeue).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any, Union

import torch
from yacs.config import CfgNode

from distribuuuu import (
    calibration,
    config,
    data,
    engine,
    inference,
    inferred,
    model_card,
    models,
    run_folder,
    strategies,
)
from distribuuuu.engine import HookBase, evaluation
from distribuuuu.errors import UserError
from distribuuuu.inference import LoadedModel
from distribuuuu.inferred.data import training_data_is_test_data
from distribuuuu.launch import comm, launcher, signals, store
from distribuuuu.logger import LOGGER_NAME, accuracies, discard_log, release_log, setup_logging

__all__ = [
    "train",
    "evaluate",
    "load_model",
    "run_command",
    "run_eval",
    "check_before_start",
    "LoadedModel",
]

log = logging.getLogger(LOGGER_NAME)

ConfigLike = Union[CfgNode, str, "os.PathLike[str]"]


# ---------------------------------------------------------------------------------------------
# Checks before any process group starts
# ---------------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**40:.1f} TiB" if n >= 2**40 else f"{n / 2**30:.1f} GiB"


def _check_batch_fits(command: str, cfg: Any) -> None:
    """Refuse an input batch that alone exceeds the host's memory,
    before anything is allocated: TRAIN.IM_SIZE 200000 would otherwise
    end in an allocator traceback per rank. The GPU's memory is not
    asked here: that would initialise CUDA in the launching process (the
    spawner's parent)."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for key in ("TEST",) if command == "eval" else ("TRAIN", "TEST"):
        batch, side = cfg[key].BATCH_SIZE, cfg[key].IM_SIZE
        size = batch * cfg.MODEL.IN_CHANS * side * side * 4  # float32, as the model sees it
        if size > limit:
            raise UserError(
                f"one {'training' if key == 'TRAIN' else 'evaluation'} batch ({key}.BATCH_SIZE "
                f"{batch} images of {cfg.MODEL.IN_CHANS}x{side}x{side}, float32) is {_gib(size)}, "
                f"more than this host's {_gib(limit)} of memory before any activation; lower "
                f"{key}.IM_SIZE (e.g. 224) or {key}.BATCH_SIZE"
            )


def check_before_start(
    command: str, cfg: Any, world_size: int, all_ranks_here: bool = True
) -> list[str]:
    """Checks that need no process group, run before any starts so no
    rank is left waiting (a user error here ends every rank alike, at
    once). Run by ``run_command`` in each process, and once more by the
    CLI before the spawner starts its children, so a bad config fails
    once, not once per rank.

    command: "train" or "eval". all_ranks_here: every rank runs on this
    host (plain, spawner, one-node torchrun/srun). Returns the data's
    notes (data.check_datasets) for rank 0's setup lines.
    """
    if (
        command == "eval"
    ):  # the weights run_eval will use, before anything about the data: what eval misses first
        inference.require_model_classes(inference.chosen_weights(cfg, "eval"))
    models.resolve_arch(cfg.MODEL.ARCH)  # an unknown name fails here, once, not in every rank
    _check_batch_fits(command, cfg)
    strategies.strategy_class(cfg.DIST.STRATEGY).check_config(
        cfg, world_size
    )  # its own rules (strategies/)
    if command == "train" and cfg.MODEL.WEIGHTS:  # eval's: chosen_weights, above
        inference.require_weights_file(cfg.MODEL.WEIGHTS)
    pretrained = cfg.MODEL.PRETRAINED
    if isinstance(pretrained, str) and not cfg.MODEL.WEIGHTS and not os.path.isfile(pretrained):
        raise UserError(
            f"MODEL.PRETRAINED {pretrained!r} does not exist; give the path of a weights file, or "
            "True for MODEL.ARCH's file in torch hub's cache"
        )
    notes = data.check_datasets(cfg, world_size, train=(command == "train"))
    run_folder.check_folder(
        cfg, command, all_ranks_here
    )  # OUT_DIR usable, not another run's, resumable
    return notes


# ---------------------------------------------------------------------------------------------
# One command in this process
# ---------------------------------------------------------------------------------------------
def _as_cfg(cfg: ConfigLike) -> CfgNode:
    """A CfgNode as given (checked again: it may have been edited since
    load_config), or a YAML path loaded."""
    if isinstance(cfg, CfgNode):
        config.validate(cfg)
        return cfg
    if isinstance(cfg, (str, os.PathLike)):
        return config.load_config(os.fspath(cfg))
    raise TypeError(
        "cfg must be a CfgNode from distribuuuu.config.load_config or a YAML path, not "
        f"{type(cfg).__name__}"
    )


def _fit(cfg: CfgNode, ctx: comm.DistContext, hooks: Sequence[HookBase]) -> dict[str, Any]:
    """engine.fit with the preemption signals recorded; requeue (rank 0)
    before Preempted goes up."""
    try:
        with signals.preemption_signals(cfg.TRAIN.PREEMPT_SIGNALS):
            return engine.fit(cfg, ctx, hooks=tuple(hooks))
    except signals.Preempted:
        if cfg.TRAIN.REQUEUE and ctx.is_main:
            signals.slurm_requeue()
        raise  # "ended by this signal", after the checkpoint: the CLI exits with 128 + signal
    except Exception as e:  # a crash: name the rank in log.txt, where every rank's errors go
        stopped = store.stopped_peer(e)
        if stopped is not None:  # another rank's stop signal broke the collective: a stop here too
            raise stopped from None
        # A UserError (e.g. engine.NonFiniteLoss) is printed once by the
        # CLI: log.txt only here.
        log.error(
            "rank %d failed: %s: %s",
            ctx.rank,
            type(e).__name__,
            e,
            extra={"console": not isinstance(e, UserError)},
        )
        raise


def run_command(command: str, cfg: CfgNode, hooks: Sequence[HookBase] = ()) -> dict[str, Any]:
    """Run "train" or "eval" in this process (any launcher); return the
    summary / the eval record.

    Checks first (preflight, before any process group), then the process
    group, the run folder's lock (train: rank 0 holds OUT_DIR/run.lock
    to the end, however the run ends), logging, the config written to
    OUT_DIR (rank 0), and the run. The CLI's train and eval are this
    function plus exit statuses.
    """
    if command not in ("train", "eval"):
        raise ValueError(f"command must be 'train' or 'eval', not {command!r}")
    new_folder = not os.path.lexists(
        cfg.OUT_DIR
    )  # made for this command: a refusal takes it away again
    try:
        return _run_checked(command, cfg, hooks)
    except UserError:
        if new_folder:
            run_folder.remove_if_empty(cfg.OUT_DIR)
        raise


def _run_checked(command: str, cfg: CfgNode, hooks: Sequence[HookBase]) -> dict[str, Any]:
    info = launcher.detect()  # once per process: the process group takes it
    cfg = inferred.resolve(
        cfg, info.local_world_size
    )  # the keys left unset, decided from the data once
    data_notes = check_before_start(
        command, cfg, info.world_size, all_ranks_here=info.local_world_size == info.world_size
    )
    strategy = strategies.strategy_class(cfg.DIST.STRATEGY)  # what its process group needs
    with (
        comm.session(cfg, info, strategy) as ctx,
        run_folder.owned(cfg, ctx, lock=command == "train") as notes,
    ):
        # log.txt and the run record (config.yaml, env.json, ...) wait
        # for every check to pass (engine.fit: RunFolder.write_record):
        # a refused command leaves OUT_DIR as it was.
        setup_logging(cfg.OUT_DIR, ctx.is_main, ctx.rank, hold=True)
        run_folder.log_notes(notes)  # a stale lock taken over, debris removed
        refused = False
        try:
            if ctx.is_main:
                inferred.log_decisions(cfg)  # the values decided from the data, with their origins
                for note in data_notes:  # what the data's checks want said (a small evaluation set)
                    log.info("setup: %s", note)
            if command == "eval":
                return run_eval(cfg, ctx)
            return _fit(cfg, ctx, hooks)
        except UserError:
            refused = True
            discard_log()
            raise
        finally:  # however the run ended: its loader workers ignore stop signals (data.batches)
            data.stop_workers()
            if not refused:  # a crash or a stop: its lines are kept
                release_log()


def run_eval(cfg: CfgNode, ctx: comm.DistContext) -> dict[str, Any]:
    """Evaluate MODEL.WEIGHTS (or the run folder's best/last checkpoint)
    on TEST.DATASET / TEST.SPLIT."""
    cfg = inference.chosen_weights(cfg, "eval")  # the one resolution of eval, predict and export
    weights = cfg.MODEL.WEIGHTS
    run = run_folder.RunFolder(cfg)
    engine.seed_evaluation(cfg, ctx.rank)
    model = models.build_model(cfg).to(ctx.device)  # loads MODEL.WEIGHTS
    if cfg.TRAIN.VAL_SPLIT and training_data_is_test_data(
        cfg
    ):  # a folder of class folders: its held-out part
        log.info(
            "[eval] TEST.DATASET is the training data: evaluating the part TRAIN.VAL_SPLIT %g "
            "held out",
            cfg.TRAIN.VAL_SPLIT,
        )
        loader = data.build_val_loader(cfg, ctx.rank, ctx.world_size, ctx.device)
    # never the held-out split; e.g. TEST.DATASET the whole training
    # folder: the overlap is counted
    else:
        _check_eval_overlap(cfg, ctx.is_main)
        loader = data.build_test_loader(cfg, ctx.rank, ctx.world_size, ctx.device)
    card = inference.file_card(weights)  # its temperature: the ECE before and after
    start = time.perf_counter()
    result = engine.evaluate(model, loader, cfg, ctx, temperature=card.temperature if card else 1.0)
    confusion, classes = result.pop("confusion"), model_card.describe(cfg, loader.dataset).classes
    log.info(
        "[eval] %s | loss %.4f | %s | balanced top-1 %.2f%% | %s | n %d | %.1fs%s",
        weights,
        result["loss"],
        accuracies(result["top1"], cfg.TRAIN.TOPK, result["topk_acc"], "top-", "%"),
        result["balanced_top1"],
        calibration.ece_text(result),
        result["n"],
        time.perf_counter() - start,
        evaluation.thinly_judged(classes, confusion),
    )
    log.info(
        "[eval] worst classes: %s",
        evaluation.worst_classes(classes, result["per_class_top1"], confusion),
    )
    record = {"epoch": None, "split": "val", **result, "topk": cfg.TRAIN.TOPK, "weights": weights}
    run.write_eval_record(record, ctx.is_main)  # eval.jsonl: never the run's metrics.jsonl
    if cfg.TEST.OUT_DIR and ctx.is_main:
        log.info(
            "[eval] wrote %s",
            run.write_confusion(evaluation.confusion_csv(classes, confusion), cfg.TEST.OUT_DIR),
        )
    return record


def _check_eval_overlap(cfg: CfgNode, is_main: bool) -> None:
    """data.check_overlap for eval of a TEST.DATASET other than the
    training data (the whole training folder, or a copy of it: its
    training images would be scored without a word), when the training
    data is here; a checkpoint's training folder that is not here is
    said instead."""
    t = cfg.TRAIN
    if os.path.exists(t.DATASET) or t.DATASET in data.source_names() or "{" in t.DATASET:
        return data.check_overlap(cfg, is_main)
    if is_main and t.OVERLAP != "off":
        log.warning(
            "TRAIN.DATASET %r is not here, so whether TEST.DATASET %r holds training images is "
            "not checked",
            t.DATASET,
            cfg.TEST.DATASET,
        )


def train(cfg: ConfigLike, hooks: Sequence[HookBase] = ()) -> dict[str, Any]:
    """Train as ``distribuuuu train`` does, in this process; return the
    run's summary.

    hooks: ``distribuuuu.engine.HookBase`` instances, run after the
    built-in hooks and those of TRAIN.HOOKS (event order:
    distribuuuu/engine/hooks.py). Each rank runs its own.
    """
    return run_command("train", _as_cfg(cfg), hooks)


def evaluate(cfg: ConfigLike) -> dict[str, Any]:
    """Evaluate as ``distribuuuu eval`` does: MODEL.WEIGHTS, else
    OUT_DIR's best.pth / last.pth.

    Returns the record also appended to OUT_DIR/eval.jsonl (loss, top1,
    topk_acc, topk, n, ...).
    """
    return run_command("eval", _as_cfg(cfg))


def load_model(
    checkpoint_path: str | os.PathLike[str], device: str | torch.device = "cpu", ema: bool = False
) -> LoadedModel:
    """The model of a distribuuuu checkpoint, ready for inference, with
    its preprocessing.

    Returns a LoadedModel: ``.model`` (eval mode, on device),
    ``.transform`` (PIL image -> the model's input tensor, as evaluation
    prepares images), ``.classes`` (the name of each output),
    ``.config`` (the run's config) and ``.card`` (the checkpoint's model
    card, model_card.py). The architecture and the preprocessing come
    from the checkpoint's card (an older checkpoint: from its stored
    config); the file is read with ``weights.load_checkpoint`` (tensors
    only, integrity digest verified). ema=True loads the EMA weights
    (TRAIN.EMA runs). A sharded FSDP checkpoint (DIST.FSDP_STATE_DICT
    sharded) is refused: its weights are spread over a .dcp folder.

        loaded = load_model("runs/api/checkpoints/best.pth")
        probs = loaded.model(loaded.transform(image)[None]).softmax(1)
    """
    return inference.load(os.fspath(checkpoint_path), device, ema)
