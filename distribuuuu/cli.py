"""The `distribuuuu` command: train, eval, config, data, plot, bench, predict, export.

    distribuuuu train  [--cfg FILE] [--nproc-per-node N] [KEY VALUE ...]
    distribuuuu eval   [--cfg FILE] [--nproc-per-node N] [MODEL.WEIGHTS PATH] [KEY VALUE ...]
    distribuuuu config [--cfg FILE] [KEY VALUE ...]      print the merged, validated config
    distribuuuu data export mnist5k DIR                   write the embedded digits as an ImageFolder tree
    distribuuuu plot RUN_DIR [RUN_DIR ...] [--out DIR]    learning-curve PNGs of one or more runs
    distribuuuu bench [--cfg FILE] [--scaling 1,2,4] [KEY VALUE ...]   model / data / step timings, scaling
    distribuuuu bench --compare single,dp,ddp,ddp+amp [--cfg FILE] [KEY VALUE ...]   one job, four ways
    distribuuuu predict [--cfg FILE] MODEL.WEIGHTS PATH [KEY VALUE ...] IMAGE ...   top-5 classes
    distribuuuu export [--cfg FILE] [--out DIR] MODEL.WEIGHTS PATH [KEY VALUE ...]  TorchScript, ONNX, safetensors

The same train/eval run under plain python, torchrun, torch.distributed.launch, srun, or the
built-in spawner (--nproc-per-node). A user error exits with status 2 and one message.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Callable, Sequence

from distribuuuu.errors import USER_ERROR_EXIT, UserError


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as UserError (exit 2, one message) instead of printing usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _add_cfg_args(parser: argparse.ArgumentParser, with_nproc: bool) -> None:
    parser.add_argument("--cfg", dest="cfg_file", default=None, help="YAML config file (see config/)")
    if with_nproc:
        parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", default=None,
                            help="start N processes on this machine with the built-in spawner "
                                 "('auto': one per GPU, else one per CPU core)")
        parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                            help="with --nproc-per-node: the rendezvous port (default: MASTER_PORT if "
                                 "set, else a free one); a port in use is replaced by a free one")
    # torch.distributed.launch passes --local-rank=N (or --local_rank); the rank is read from the
    # environment instead (see distributed.detect), so the value is accepted and ignored here.
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE pairs overriding the config")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="distribuuuu", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_cfg_args(sub.add_parser("train", help="train a model"), with_nproc=True)
    _add_cfg_args(sub.add_parser("eval", help="evaluate MODEL.WEIGHTS on the val split"), with_nproc=True)
    _add_cfg_args(sub.add_parser("config", help="print the merged, validated config as YAML"), with_nproc=False)
    data_parser = sub.add_parser("data", help="dataset utilities")
    data_sub = data_parser.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    export = data_sub.add_parser("export", help="write a built-in dataset as an ImageFolder tree")
    export.add_argument("source", choices=["mnist5k"])
    export.add_argument("dest", help="output folder (gets train/<class>/*.png and val/<class>/*.png)")
    _add_tool_parsers(sub)
    return parser


def _add_tool_parsers(sub: argparse._SubParsersAction) -> None:
    """plot, bench, predict, export: what users look at (see their modules' docstrings)."""
    plot = sub.add_parser("plot", help="learning-curve PNGs of one or more run folders")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="OUT_DIR of a training run")
    plot.add_argument("--out", default=None, help="folder for the PNGs (default RUN_DIR/plots, or ./plots)")
    bench = sub.add_parser("bench", help="time the model, the data loader and the step; --scaling sweeps processes")
    _add_cfg_args(bench, with_nproc=False)
    bench.add_argument("--iters", type=int, default=20, help="timed iterations per measurement")
    bench.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    bench.add_argument("--scaling", default=None, metavar="LIST",
                       help="process counts such as 1,2,4: train the same short run with each")
    bench.add_argument("--compare", default=None, metavar="LIST",
                       help="methods such as single,dp,ddp,ddp+amp: train the same short job each way")
    bench.add_argument("--epochs", type=int, default=None,
                       help="epochs of each run: --scaling times the last (default 1), --compare all but "
                            "the first (default 2)")
    bench.add_argument("--nproc", type=int, default=None,
                       help="--compare: processes of the ddp runs (default one per GPU, 2 on the CPU)")
    bench.add_argument("--global-batch", dest="global_batch", type=int, default=None,
                       help="--compare: the batch of each optimizer step, split over the processes "
                            "(default TRAIN.BATCH_SIZE)")
    bench.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16"],
                       help="--compare: autocast type of ddp+amp (auto: bf16 on CPU and on GPUs with native "
                            "bf16, else fp16)")
    bench.add_argument("--out", default=None, help="results folder (default OUT_DIR/bench)")
    predict = sub.add_parser("predict", help="top-k classes of image files")
    _add_cfg_args(predict, with_nproc=False)
    predict.add_argument("--topk", type=int, default=5, help="how many classes to print per image")
    export = sub.add_parser("export", help="TorchScript, ONNX and safetensors files of MODEL.WEIGHTS, checked")
    _add_cfg_args(export, with_nproc=False)
    export.add_argument("--out", default=None, help="output folder (default OUT_DIR/export)")
    export.add_argument("--tol", type=float, default=1e-4, help="largest allowed |exported - eager| on the logits")
    export.add_argument("--batch", type=int, default=4, help="batch size of the check")


TOOLS = ("plot", "bench", "predict", "export")


def _options_first(tokens: list[str]) -> list[str]:
    """The tools' --options may also follow the KEY VALUE pairs and paths (argparse's REMAINDER
    would take them as config keys): move each, with its value, to the front."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(tokens):
        take = (1 if "=" in tokens[i] else 2) if tokens[i].startswith("--") else 0
        if take:
            front += tokens[i:i + take]
        else:
            rest.append(tokens[i])
        i += take or 1
    return front + rest


def _run_tool(args: argparse.Namespace) -> int:
    opts = list(getattr(args, "opts", None) or [])
    if args.command == "plot":
        from distribuuuu import plot

        return plot.main(args.run_dirs, args.out)
    if args.command == "bench":
        return _run_bench(args, opts)
    if args.command == "predict":
        from distribuuuu import predict

        return predict.main(args.cfg_file, opts, args.topk)
    from distribuuuu import export

    return export.main(args.cfg_file, opts, args.out, args.tol, args.batch)


def _run_bench(args: argparse.Namespace, opts: list[str]) -> int:
    """bench: the one-process timings, --scaling (bench.py) or --compare (compare.py)."""
    if args.compare is None:
        from distribuuuu import bench

        epochs = 1 if args.epochs is None else args.epochs
        return bench.main(args.cfg_file, opts, args.iters, args.warmup, args.scaling, epochs, args.out)
    if args.scaling is not None:
        raise UserError("--compare and --scaling are two different sweeps; give one of them")
    from distribuuuu import compare

    return compare.run_compare(args.cfg_file, opts, args.compare, 2 if args.epochs is None else args.epochs,
                               args.out, args.nproc, args.global_batch, args.amp)


def _resolve_nproc(value: str | None) -> int | None:
    if value is None:
        return None
    if value == "auto":
        import torch

        return torch.cuda.device_count() or os.cpu_count() or 1
    try:
        n = int(value)
    except ValueError:
        raise UserError(f"--nproc-per-node takes a positive integer or 'auto', got {value!r}") from None
    if n < 1:
        raise UserError(f"--nproc-per-node must be at least 1, got {n}")
    return n


def _gib(n: float) -> str:
    return f"{n / 2**40:.1f} TiB" if n >= 2**40 else f"{n / 2**30:.1f} GiB"


def _check_batch_fits(command: str, cfg) -> None:
    """Refuse an input batch that alone exceeds the host's memory, before anything is allocated:
    TRAIN.IM_SIZE 200000 would otherwise end in an allocator traceback per rank. The GPU's memory is
    not asked here: that would initialise CUDA in the launching process (the spawner's parent)."""
    limits = [("this host's", os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))]
    splits = [("TEST", "evaluation")] if command == "eval" else [("TRAIN", "training"), ("TEST", "evaluation")]
    for group, what in splits:
        batch, side = cfg[group].BATCH_SIZE, cfg[group].IM_SIZE
        size = batch * cfg.MODEL.IN_CHANS * side * side * 4  # float32, as the model sees it
        for where, limit in limits:
            if size > limit:
                raise UserError(
                    f"one {what} batch ({group}.BATCH_SIZE {batch} images of {cfg.MODEL.IN_CHANS}x{side}x{side}, "
                    f"float32) is {_gib(size)}, more than {where} {_gib(limit)} of memory before any "
                    f"activation; lower {group}.IM_SIZE (e.g. 224) or {group}.BATCH_SIZE")


def _check_cfg_dest(cfg) -> None:
    """CFG_DEST names a file in OUT_DIR: an existing folder there cannot become one."""
    path = os.path.join(cfg.OUT_DIR, cfg.CFG_DEST)
    if os.path.isdir(path):
        raise UserError(f"CFG_DEST {cfg.CFG_DEST!r} is an existing folder in OUT_DIR ({path}); the full config "
                        "is written to that name: use a file name such as config.yaml")


def _preflight(command: str, cfg, world_size: int, all_ranks_here: bool = True) -> None:
    """Checks that need no process group, run before any starts so no rank is left waiting.
    all_ranks_here: every rank runs on this host (plain, spawner, one-node torchrun/srun)."""
    from distribuuuu import data, models, resume_check, run_folder

    models.resolve_arch(cfg.MODEL.ARCH)  # an unknown name fails here, once, not in every rank
    _check_batch_fits(command, cfg)
    if command == "train":
        _check_cfg_dest(cfg)
    if cfg.DIST.STRATEGY == "dp" and world_size > 1:
        raise UserError(f"DIST.STRATEGY dp is ONE process driving all local GPUs, but {world_size} processes "
                        "were started; run it with plain python, or use DIST.STRATEGY ddp")
    if command == "eval":
        if cfg.MODEL.WEIGHTS and not os.path.isfile(cfg.MODEL.WEIGHTS):
            raise UserError(f"MODEL.WEIGHTS {cfg.MODEL.WEIGHTS!r} does not exist")
    elif cfg.MODEL.WEIGHTS and not os.path.isfile(cfg.MODEL.WEIGHTS):
        raise UserError(f"MODEL.WEIGHTS {cfg.MODEL.WEIGHTS!r} does not exist; give the path of a "
                        "checkpoint or state dict, or leave MODEL.WEIGHTS None")
    data.check_datasets(cfg, world_size, train=(command == "train"))
    run_folder.preflight(cfg, command, all_ranks_here)  # OUT_DIR usable and not another run's
    if command == "train":  # an edited config must not resume a run it does not fit (before config.yaml is written)
        resume_check.preflight(cfg)


def run(command: str, cfg_file: str | None, opts: list[str]) -> int:
    """Run train or eval in this process (any launcher); returns the exit status."""
    from distribuuuu import config, distributed, engine, faults, run_folder
    from distribuuuu.logger import LOGGER_NAME, setup_logging

    cfg = config.load_config(cfg_file, opts)
    info = distributed.detect()
    _preflight(command, cfg, info.world_size, all_ranks_here=info.local_world_size == info.world_size)
    # A train run holds OUT_DIR/run.lock (rank 0) from here to its end, however it ends.
    with distributed.session(cfg) as ctx, run_folder.owned(cfg, ctx, lock=command == "train") as notes:
        setup_logging(cfg.OUT_DIR, ctx.is_main, ctx.rank)
        run_folder.log_notes(notes)  # a stale lock taken over, debris removed
        if command == "eval":
            engine.run_eval(cfg, ctx)
            return 0
        if ctx.is_main:
            config.dump_to_run_folder(cfg, cfg.OUT_DIR)
        try:
            with faults.preemption_signals(cfg.TRAIN.PREEMPT_SIGNALS):
                engine.fit(cfg, ctx)
        except engine.Preempted as stop:
            if cfg.TRAIN.REQUEUE and ctx.is_main:
                distributed.slurm_requeue()
            return 128 + stop.signum  # "ended by this signal", after the checkpoint
        except Exception as e:  # a crash: name the rank in log.txt, where every rank's errors go
            # A UserError (e.g. engine.NonFiniteLoss) is printed once by _guarded: log.txt only here.
            logging.getLogger(LOGGER_NAME).error("rank %d failed: %s: %s", ctx.rank, type(e).__name__, e,
                                                 extra={"console": not isinstance(e, UserError)})
            raise
    return 0


def _spawned(command: str, cfg_file: str | None, opts: list[str]) -> None:
    """Entry point of each process started by --nproc-per-node (module-level: it is pickled)."""
    sys.exit(_guarded(lambda: run(command, cfg_file, opts)))


def _guarded(fn: Callable[[], int]) -> int:
    """Run fn; a UserError becomes one message on stderr and exit status 2."""
    try:
        return fn()
    except UserError as e:
        rank = os.environ.get("RANK", "0")
        prefix = "error" if rank == "0" else f"error (rank {rank})"
        # One write of the whole line: print() writes text and newline apart, and the ranks of a
        # spawned job share stderr (two ranks' lines were seen glued together).
        sys.stderr.write(f"{prefix}: {e}\n")
        sys.stderr.flush()
        return USER_ERROR_EXIT
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (distributed.Terminated): see handle_stop_signals
        signum = int(getattr(e, "signum", signal.SIGINT))
        rank = os.environ.get("RANK", "0")
        who = "" if rank == "0" else f" (rank {rank})"
        print(f"stopped by {signal.Signals(signum).name}{who}", file=sys.stderr, flush=True)
        return 128 + signum  # 130 for Ctrl-C, 143 for SIGTERM


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        argv = [argv[0], *_options_first(argv[1:])]
    args = build_parser().parse_args(argv)
    if args.command in TOOLS:
        return _run_tool(args)
    if args.command == "data":
        from distribuuuu import data

        counts = data.export_mnist5k(args.dest)
        print(f"wrote {args.source} to {args.dest}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        return 0
    opts = list(args.opts or [])
    if args.command == "config":
        from distribuuuu import config

        print(config.to_yaml(config.load_config(args.cfg_file, opts)), end="")
        return 0
    nproc = _resolve_nproc(args.nproc)
    if nproc is None:
        if args.master_port is not None:
            raise UserError("--master-port goes with --nproc-per-node; under torchrun or "
                            "torch.distributed.launch give it to the launcher, elsewhere set MASTER_PORT")
        return run(args.command, args.cfg_file, opts)

    from distribuuuu import config, distributed

    if distributed.detect().launcher != "plain":
        raise UserError("--nproc-per-node starts its own processes; drop it when running under "
                        "torchrun, torch.distributed.launch or srun")
    cfg = config.load_config(args.cfg_file, opts)  # fail here, once, before any child starts
    _preflight(args.command, cfg, nproc)
    return distributed.spawn(_spawned, nproc, args=(args.command, args.cfg_file, opts), port=args.master_port)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the process exit status."""
    return _guarded(lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
