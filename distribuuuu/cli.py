"""The `distribuuuu` command: train, eval, config, data, plot, bench, predict, export.

    distribuuuu train  [--cfg FILE] [--nproc-per-node N] [KEY VALUE ...]
    distribuuuu eval   [--cfg FILE] [--nproc-per-node N] --checkpoint PATH [KEY VALUE ...]
    distribuuuu config [--cfg FILE] [KEY VALUE ...]      print the merged, validated config
    distribuuuu config --explain KEY | --list            a key's comment, type and default | the shipped configs
    distribuuuu data export mnist5k DIR                   write the embedded digits as an ImageFolder tree
    distribuuuu data shard SRC DEST [--shard-size 256MB]  an image folder (or mnist5k) as tar shards + index.json
    distribuuuu plot RUN_DIR [RUN_DIR ...] [--out DIR]    learning-curve PNGs of one or more runs
    distribuuuu bench [--cfg FILE] [--scaling 1,2,4] [KEY VALUE ...]   model / data / step timings, scaling
    distribuuuu bench --compare single,dp,ddp,ddp+amp [--cfg FILE] [KEY VALUE ...]   one job, four ways
    distribuuuu bench --io [--workers 0,1,2] [--cfg FILE] [KEY VALUE ...]   loader img/s: folder vs shards
    distribuuuu predict [--cfg FILE] --checkpoint PATH [KEY VALUE ...] IMAGE|FOLDER|'GLOB' ... [--output F.csv|F.json]
    distribuuuu export [--cfg FILE] [--out DIR] --checkpoint PATH [KEY VALUE ...]  TorchScript, ONNX, safetensors

--checkpoint PATH is the same as MODEL.WEIGHTS PATH. Options may also follow the KEY VALUE pairs.

eval, predict and export need no --cfg for a checkpoint of `distribuuuu train`: its stored config,
class names and preprocessing are used (distribuuuu/inference.py); --cfg and KEY VALUE still win.

--cfg takes a YAML file or a shipped config's name (`--cfg mnist5k_fast`); a file that exists wins.

The same train/eval run under plain python, torchrun, torch.distributed.launch, srun, or the
built-in spawner (--nproc-per-node). A user error exits with status 2 and one message.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from distribuuuu import cli_help, data_cli  # light: argparse only; the data code is imported when a command runs
from distribuuuu.errors import NOT_SAVED_EXIT, USER_ERROR_EXIT, RunNotSaved, UserError, report_line
from distribuuuu.launch.launcher import rank_label  # light: no torch; the rank for message prefixes


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says what the default is
    (an option whose default is None must say it in words: "None" tells the user nothing); the
    examples that end each --help keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action) or text


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as UserError (exit 2, one message) instead of printing usage,
    and whose --help shows every option's default."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _add_cfg_args(parser: argparse.ArgumentParser, with_nproc: bool, stored: bool = False,
                  opts_help: str = "KEY VALUE pairs overriding the config") -> None:
    """stored: the command reads a checkpoint, whose stored config is the default (inference.load_config)."""
    default = ("the config stored in the checkpoint that MODEL.WEIGHTS names (else the built-in defaults)"
               if stored else "the built-in defaults")
    parser.add_argument("--cfg", dest="cfg_file", default=None,
                        help="YAML config file, or a shipped config's name (`distribuuuu config --list`); "
                             f"default: none, {default}")
    if stored:
        parser.add_argument("--checkpoint", default=None, metavar="PATH",
                            help="the checkpoint (or weights file) to use: the same as MODEL.WEIGHTS PATH "
                                 "(default: none, MODEL.WEIGHTS, else the checkpoint OUT_DIR's run chose)")
    if with_nproc:
        parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", default=None,
                            help="start N processes on this machine with the built-in spawner "
                                 "('auto': one per GPU, else one per CPU core); default: none, one process "
                                 "(or what torchrun / srun started)")
        parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                            help="with --nproc-per-node: the rendezvous port (default: MASTER_PORT if "
                                 "set, else a free one); a port in use is replaced by a free one")
    # torch.distributed.launch passes --local-rank=N (or --local_rank); the rank is read from the
    # environment instead (see launch.launcher.detect), so the value is accepted and ignored here.
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--import", dest="imports", action="append", default=None, metavar="MODULE",
                        help="import MODULE (a dotted name or a .py file) in every process before the model "
                             "and data are built, e.g. to register a timm model; repeatable, adds to IMPORTS "
                             "(default: none beyond the config's IMPORTS)")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help=opts_help)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="distribuuuu", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"distribuuuu {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser = cli_help.with_examples(sub.add_parser)  # type: ignore[method-assign]
    _add_cfg_args(sub.add_parser("train", help="train a model"), with_nproc=True)
    _add_cfg_args(sub.add_parser("eval", help="evaluate a checkpoint (--checkpoint PATH) on the val split "
                                 "(without --cfg: with the config stored in the checkpoint)"), with_nproc=True, stored=True)
    config_parser = sub.add_parser("config", help="print the merged, validated config as YAML")
    config_parser.add_argument("--list", dest="list_shipped", action="store_true",
                               help="list the shipped configs (usable as --cfg NAME) instead")
    config_parser.add_argument("--explain", default=None, metavar="KEY",
                               help="print KEY's comment, type and default instead (default: none)")
    _add_cfg_args(config_parser, with_nproc=False)
    data_cli.add_parser(sub, _Parser)
    _add_tool_parsers(sub)
    return parser


def _add_tool_parsers(sub: argparse._SubParsersAction) -> None:
    """plot, bench, predict, export: what users look at (see their modules' docstrings)."""
    plot = sub.add_parser("plot", help="learning-curve PNGs of one or more run folders")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="OUT_DIR of a training run")
    plot.add_argument("--out", default=None, help="folder for the PNGs (default RUN_DIR/plots, or ./plots)")
    bench = sub.add_parser("bench", help="time the model, the data loader and the step; --scaling sweeps processes")
    _add_cfg_args(bench, with_nproc=False)
    bench.add_argument("--iters", type=int, default=20,
                       help="timed iterations per measurement (the model's: at least this many calls' time, "
                            "in blocks chosen by torch.utils.benchmark.Timer)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    bench.add_argument("--scaling", default=None, metavar="LIST",
                       help="process counts such as 1,2,4: train the same short run with each (default: none, "
                            "no scaling sweep)")
    bench.add_argument("--compare", default=None, metavar="LIST",
                       help="methods such as single,dp,ddp,ddp+amp: train the same short job each way "
                            "(default: none, no comparison)")
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
    bench.add_argument("--io", action="store_true",
                       help="time the training data loader alone against the number of loader workers, "
                            "image folder vs shards of the same images (io.csv, io.png)")
    bench.add_argument("--workers", default=None, metavar="LIST",
                       help="--io: loader worker counts such as 0,1,2 (default 0, then 1, 2, 4, ... up to the cores)")
    bench.add_argument("--repeats", type=int, default=3, help="--io: timed stretches of --iters batches each")
    bench.add_argument("--io-shards", dest="io_shards", default=None, metavar="DIR",
                       help="--io: keep the shards of a folder dataset in DIR and reuse them (default: none, "
                            "written to a temporary folder and removed)")
    bench.add_argument("--out", default=None, help="results folder (default OUT_DIR/bench)")
    predict = sub.add_parser("predict", help="top-k classes of image files, folders and globs (without --cfg: "
                             "the checkpoint's config, class names and preprocessing)")
    _add_cfg_args(predict, with_nproc=False, stored=True,
                  opts_help="KEY VALUE pairs overriding the config, and the images: files, folders, 'globs'")
    predict.add_argument("--topk", type=int, default=5, help="how many classes to print per image")
    predict.add_argument("--output", default=None, metavar="FILE",
                         help="write the predictions to FILE, CSV or JSON by its suffix (preds.csv, preds.json); "
                              "default: none, a table on stdout")
    predict.add_argument("--format", dest="fmt", default=None, choices=["csv", "json"],
                         help="csv or json, whatever --output's suffix; without --output: to stdout "
                              "(default: from --output's suffix)")
    export = sub.add_parser("export", help="TorchScript, ONNX and safetensors files of MODEL.WEIGHTS, checked, "
                            "each with the model card (without --cfg: the checkpoint's config)")
    _add_cfg_args(export, with_nproc=False, stored=True)
    export.add_argument("--out", default=None, help="output folder (default OUT_DIR/export)")
    export.add_argument("--tol", type=float, default=1e-4, help="largest allowed |exported - eager| on the logits")
    export.add_argument("--batch", type=int, default=4, help="batch size of the check")


def package_version() -> str:
    """The installed distribution's version; the package's own __version__ when run from a
    checkout that is not installed."""
    try:
        return importlib.metadata.version("distribuuuu")
    except importlib.metadata.PackageNotFoundError:
        from distribuuuu import __version__

        return __version__


def _print_config(args: argparse.Namespace, opts: list[str]) -> int:
    """`distribuuuu config`: the merged config as YAML, the unset keys decided from the data as one
    process would (inferred.py); with --list the shipped configs, with --explain KEY one key."""
    from distribuuuu import config, inferred

    if args.explain is not None:
        print(cli_help.explain(args.explain), end="")
        return 0
    if args.list_shipped:
        if args.cfg_file or opts:
            raise UserError("config --list lists the shipped configs; it takes no --cfg or KEY VALUE "
                            "(drop them, or drop --list to print a merged config)")
        from distribuuuu.config import shipped

        print(shipped.listing(), end="")
        return 0
    cfg = inferred.resolve(config.load_config(args.cfg_file, opts), 1)
    from distribuuuu import strategies  # its rules too (they import torch: only here, after the keys passed)

    strategies.strategy_class(cfg.DIST.STRATEGY).check_config(cfg, world_size=1)
    print(config.to_yaml(cfg), end="")
    return 0


def arrange(argv: list[str]) -> list[str]:
    """argv with each command's --options in front of its KEY VALUE pairs (and paths), where they may
    also be typed: `train KEY VALUE --nproc-per-node 2` (argparse's REMAINDER would take them as keys)."""
    if argv and argv[0] != "data":  # data's subcommands take plain positionals, parsed as usual
        return [argv[0], *cli_help.options_first(argv[1:])]
    return argv


def _run_bench(args: argparse.Namespace, opts: list[str]) -> int:
    """bench: the one-process timings (tools/bench.py), --scaling (tools/scaling.py), --compare
    (tools/compare.py) or --io (tools/bench_io.py). The options are checked here, before the chosen
    module imports torch."""
    sweeps = [name for name, on in (("--compare", args.compare is not None), ("--scaling", args.scaling is not None),
                                     ("--io", args.io)) if on]
    if len(sweeps) > 1:
        raise UserError(f"{' and '.join(sweeps)} are different sweeps; give one of them")
    if args.compare is not None:
        from distribuuuu.tools import compare

        return compare.run_compare(args.cfg_file, opts, args.compare, 2 if args.epochs is None else args.epochs,
                                   args.out, args.nproc, args.global_batch, args.amp)
    if args.iters < 1 or args.warmup < 0:
        raise UserError(f"--iters must be at least 1 and --warmup at least 0, got {args.iters} and {args.warmup}")
    if args.scaling is not None:
        from distribuuuu.tools import scaling

        return scaling.main(args.cfg_file, opts, args.scaling, 1 if args.epochs is None else args.epochs, args.out)
    if args.io:
        if args.repeats < 1:
            raise UserError(f"--repeats must be at least 1, got {args.repeats}")
        from distribuuuu.tools import bench_io

        return bench_io.main(args.cfg_file, opts, args.workers, (args.iters, args.warmup, args.repeats),
                             args.io_shards, args.out)
    from distribuuuu.tools import bench

    return bench.main(args.cfg_file, opts, args.iters, args.warmup, args.out)


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


def run(command: str, cfg_file: str | None, opts: list[str]) -> int:
    """Run train or eval in this process (any launcher); returns the exit status.

    The work is api.run_command's (the Python API runs the same); here only the statuses: 0, or
    128 + signal after a preemption checkpoint. UserError and stop signals: see _guarded.
    """
    from distribuuuu.launch.signals import Preempted

    cfg = command_config(command, cfg_file, opts)  # before torch is imported: a bad key is a 0.2 s exit 2
    from distribuuuu import api

    try:
        api.run_command(command, cfg)
    except Preempted as stop:
        return 128 + stop.signum  # "ended by this signal", after the checkpoint
    return 0


def command_config(command: str, cfg_file: str | None, opts: list[str]) -> Any:
    """train: --cfg and the overrides; eval: the same, or without --cfg the config stored with the
    checkpoint that MODEL.WEIGHTS (or OUT_DIR's best.pth) names (inference.load_config)."""
    if command == "eval":
        from distribuuuu import inference

        return inference.load_config(cfg_file, opts)
    from distribuuuu import config

    return config.load_config(cfg_file, opts)


def _spawned(command: str, cfg_file: str | None, opts: list[str]) -> None:
    """Entry point of each process started by --nproc-per-node (module-level: it is pickled)."""
    sys.exit(_guarded(lambda: run(command, cfg_file, opts)))


def _guarded(fn: Callable[[], int]) -> int:
    """Run fn; a UserError becomes one message on stderr and exit status 2, a run that could not
    save one message and status 3, a stop signal one line and 128 + the signal."""
    try:
        return fn()
    except (UserError, RunNotSaved) as e:  # RunNotSaved: every rank agreed on it (an any_rank vote)
        rank = rank_label()
        report_line(f"{'error' if rank == '0' else f'error (rank {rank})'}: {e}")
        return USER_ERROR_EXIT if isinstance(e, UserError) else NOT_SAVED_EXIT
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (launch.signals.Terminated): see handle_stop_signals
        signum = int(getattr(e, "signum", signal.SIGINT))
        rank = rank_label()
        who = "" if rank == "0" else f" (rank {rank})"
        peer = getattr(e, "peer", None)  # launch.signals.PeerStopped: the signal reached another rank
        who += "" if peer is None else f": rank {peer} got it, and this process ended with it"
        report_line(f"stopped by {signal.Signals(signum).name}{who}")
        return 128 + signum  # 130 for Ctrl-C, 143 for SIGTERM


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:  # here rather than argparse's action, which exits the process
        print(f"distribuuuu {package_version()}")
        return 0
    try:
        args = build_parser().parse_args(arrange(argv))
    except SystemExit as e:  # --help (bad arguments raise UserError): printed; main returns the status
        return int(e.code or 0)
    _flags_as_overrides(args)
    if args.command not in ("train", "eval"):
        return _other_command(args)
    opts, nproc = list(args.opts or []), _resolve_nproc(args.nproc)
    if nproc is None:
        if args.master_port is not None:
            raise UserError("--master-port goes with --nproc-per-node; under torchrun or "
                            "torch.distributed.launch give it to the launcher, elsewhere set MASTER_PORT")
        return run(args.command, args.cfg_file, opts)
    return _spawn(args.command, args.cfg_file, opts, nproc, args.master_port)


def _flags_as_overrides(args: argparse.Namespace) -> None:
    """--import M and --checkpoint PATH become KEY VALUE overrides (IMPORTS, MODEL.WEIGHTS), so that
    spawned ranks get them too."""
    if getattr(args, "imports", None):
        from distribuuuu import config

        args.opts = config.with_imports(args.cfg_file, list(args.opts or []), args.imports)
    if getattr(args, "checkpoint", None) is not None or args.command in ("eval", "export"):
        args.opts = cli_help.with_checkpoint(args.command, getattr(args, "checkpoint", None), list(args.opts or []))


def _other_command(args: argparse.Namespace) -> int:
    """plot, bench, predict, export, data, config: each tool module (distribuuuu/tools/) is imported
    only when chosen; `distribuuuu --help` and train/eval load none of them."""
    opts = list(getattr(args, "opts", None) or [])
    if args.command == "plot":
        from distribuuuu.tools import plot

        return plot.main(args.run_dirs, args.out)
    if args.command == "bench":
        return _run_bench(args, opts)
    if args.command == "predict":
        from distribuuuu.tools import predict

        return predict.main(args.cfg_file, opts, args.topk, args.output, args.fmt)
    if args.command == "export":
        from distribuuuu.tools import export

        return export.main(args.cfg_file, opts, args.out, args.tol, args.batch)
    return data_cli.run(args) if args.command == "data" else _print_config(args, opts)


def _spawn(command: str, cfg_file: str | None, opts: list[str], nproc: int, port: int | None) -> int:
    """--nproc-per-node N: check once here, then start N processes that each run the command."""
    from distribuuuu import api, inferred, run_folder
    from distribuuuu.launch import launcher, spawn

    if launcher.detect().launcher != "plain":
        raise UserError("--nproc-per-node starts its own processes; drop it when running under "
                        "torchrun, torch.distributed.launch or srun")
    cfg = inferred.resolve(command_config(command, cfg_file, opts), nproc)  # fail here, once, before any child starts
    new_folder, status = not os.path.lexists(cfg.OUT_DIR), USER_ERROR_EXIT  # preflight makes the folder
    try:
        api.preflight(command, cfg, nproc)
        relay = cfg.TRAIN.PREEMPT_SIGNALS if command == "train" else ()  # e.g. SIGUSR1: a checkpoint, not a kill
        status = spawn.spawn(_spawned, nproc, args=(command, cfg_file, opts), port=port, relay=relay)
    finally:  # a refused run takes a folder it made away again (an empty one only: rmdir)
        if new_folder and status == USER_ERROR_EXIT:
            run_folder.remove_if_empty(cfg.OUT_DIR)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the process exit status."""
    return _guarded(lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
