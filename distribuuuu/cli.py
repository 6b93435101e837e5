"""The `distribuuuu` command: train, eval, config, data, plot, bench,
predict, export, calibrate.

    distribuuuu train  [--cfg FILE] [--nproc-per-node N] [KEY VALUE ...]
    distribuuuu eval   [--cfg FILE] [--nproc-per-node N] --checkpoint PATH [KEY VALUE ...]
    distribuuuu config [--cfg FILE] [KEY VALUE ...]      the merged, validated config
    distribuuuu config --explain KEY | --list            a key's comment | the shipped configs
    distribuuuu data export mnist5k|digits|faces DIR      a dataset a package ships, as files
    distribuuuu data shard SRC DEST [--shard-size 256MB]  image files as tar shards + index.json
    distribuuuu data index DIR [--label-field cls]        index.json for tars made elsewhere
    distribuuuu data split RUN_DIR DEST                  a run's held-out split as links
    distribuuuu plot RUN_DIR [RUN_DIR ...] [--out DIR]    learning-curve PNGs of runs
    distribuuuu bench [--cfg FILE] [--scaling 1,2,4] [KEY VALUE ...]
                                                          model / data / step timings, scaling
    distribuuuu bench --compare single,dp,ddp,ddp+amp [--cfg FILE] [KEY VALUE ...]
                                                          one job, four ways
    distribuuuu bench --io [--workers 0,1,2] [--cfg FILE] [KEY VALUE ...]
                                                          loader img/s: folder vs shards (vs tars)
    distribuuuu predict [--cfg FILE] --checkpoint PATH [KEY VALUE ...] IMAGE|FOLDER|'GLOB' ...
                        [--output F.csv|F.json]
    distribuuuu predict --model model.pt2|model.onnx IMAGE|FOLDER|'GLOB' ...
                                                          an exported file
    distribuuuu export [--cfg FILE] [--out DIR] [--format LIST] --checkpoint PATH
                       [KEY VALUE ...]                    torch.export, ONNX, safetensors
    distribuuuu calibrate [--cfg FILE] --checkpoint PATH [KEY VALUE ...]
                                                          its temperature, fitted

--checkpoint PATH is the same as MODEL.WEIGHTS PATH. Options may also
follow the KEY VALUE pairs.

eval, predict, export and calibrate need no --cfg for a checkpoint of
`distribuuuu train`: its stored config, class names and preprocessing are used
(distribuuuu/inference.py); --cfg and KEY VALUE still win.

--cfg takes a YAML file or a shipped config's name (`--cfg
mnist5k_fast`); a file that exists wins.

The same train/eval run under plain python, torchrun,
torch.distributed.launch, srun, or the built-in spawner
(--nproc-per-node). A user error exits with status 2 and one message.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from distribuuuu import cli_help  # data only: the commands' help lines, options and examples
from distribuuuu.errors import USER_ERROR_EXIT, UserError, report_line
from distribuuuu.launch.launcher import rank_label  # light: no torch; the rank for message prefixes
from distribuuuu.launch.relay import report_error  # light: a rank's error to the spawner


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help
    already says what the default is (an option whose default is None
    must say it in words: "None" tells the user nothing); the examples
    that end each --help keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return super()._get_help_string(action) or text


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as UserError (exit 2, one
    message) instead of printing usage, and whose --help shows every
    option's default."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command with its line of help (`distribuuuu --help`), and
    the options of ``command`` only: a train run builds train's alone.
    With no command, every command's options (the tests, the docs'
    check)."""
    parser = _Parser(prog="distribuuuu", description=__doc__.split("\n")[0])
    # Answered by _main before any parsing; here for `distribuuuu
    # --help` to list it.
    parser.add_argument(
        "--version",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show program's version number and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (line, options) in cli_help.COMMANDS.items():
        chosen = sub.add_parser(name, help=line, epilog=cli_help.EXAMPLES.get(name))
        if command in (None, name):
            for names, keywords in options:
                chosen.add_argument(*names, **keywords)
            if name == "data":
                _add_data_commands(chosen)
    return parser


def _add_data_commands(parser: argparse.ArgumentParser) -> None:
    """`data export`, `data shard` and `data index`, each with its
    options (cli_help.DATA_COMMANDS)."""
    sub = parser.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    for name, (line, options) in cli_help.DATA_COMMANDS.items():
        chosen = sub.add_parser(name, help=line, epilog=cli_help.EXAMPLES.get(f"data {name}"))
        for names, keywords in options:
            chosen.add_argument(*names, **keywords)


def arrange(argv: list[str]) -> list[str]:
    """argv with the command's --options, each with its value, moved in
    front of its KEY VALUE pairs (and predict's image paths), where they
    may also be typed: argparse's REMAINDER would take `train KEY VALUE
    --nproc-per-node 2` as two more config words. data's subcommands
    take plain positionals, parsed as usual."""
    if argv[:1] in ([], ["data"]):
        return argv
    front, rest, i = [argv[0]], [], 1
    while i < len(argv):
        token = argv[i]
        is_option = token.startswith("--") or token == "-h"  # not "-1": a negative value of a pair
        take = (1 if "=" in token or token in cli_help.FLAGS else 2) if is_option else 0
        (front if take else rest).extend(argv[i : i + (take or 1)])
        i += take or 1
    return front + rest


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the process exit status."""
    return _guarded(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    argv = arrange(list(sys.argv[1:] if argv is None else argv))
    if argv[:1] == ["--version"]:  # here rather than argparse's action, which exits the process
        print(f"distribuuuu {package_version()}")
        return 0
    try:
        args = build_parser(argv[0] if argv else None).parse_args(argv)
    except (
        SystemExit
    ) as e:  # --help (bad arguments raise UserError): printed; main returns the status
        return int(e.code or 0)
    _flags_as_overrides(args)
    if args.command not in ("train", "eval"):
        return _other_command(args)
    opts = list(args.opts or [])
    if args.nproc is not None:
        return _spawn(args.command, args.cfg_file, opts, _nproc(args.nproc), args.master_port)
    if args.master_port is not None:
        raise UserError(
            "--master-port goes with --nproc-per-node; under torchrun or torch.distributed.launch "
            "give it to the launcher, elsewhere set MASTER_PORT"
        )
    return run(args.command, args.cfg_file, opts)


def _guarded(fn: Callable[[], int]) -> int:
    """Run fn; a UserError becomes one message on stderr and exit status
    2, a stop signal one line and 128 + the signal."""
    try:
        return fn()
    except UserError as e:
        report_error(str(e), rank_label())
        return USER_ERROR_EXIT
    except (
        KeyboardInterrupt
    ) as e:  # Ctrl-C, or SIGTERM / SIGHUP (launch.signals.Terminated): see handle_stop_signals
        # launch.signals.PeerStopped names the rank the signal reached
        return _stopped(int(getattr(e, "signum", signal.SIGINT)), getattr(e, "peer", None))


def _stopped(signum: int, peer: int | None = None, after: str = "") -> int:
    """A process that a stop signal ended: its one line (in log.txt too,
    which outlives a closed terminal), and its status, 128 + the signal
    (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
    rank = rank_label()
    who = "" if rank == "0" else f" (rank {rank})"
    who += "" if peer is None else f": rank {peer} got it, and this process ended with it"
    line = f"stopped by {signal.Signals(signum).name}{who}{after}"
    log = logging.getLogger("distribuuuu")
    if log.handlers:  # set up (logger.setup_logging): its file only, the console gets report_line's
        log.warning(line, extra={"console": False})
    report_line(line)
    return 128 + signum


def _flags_as_overrides(args: argparse.Namespace) -> None:
    """--import M, --checkpoint PATH and eval's --out DIR become KEY
    VALUE overrides (IMPORTS, MODEL.WEIGHTS, TEST.OUT_DIR), so that
    spawned ranks get them too."""
    if getattr(args, "imports", None):
        from distribuuuu import config

        args.opts = config.with_imports(args.cfg_file, list(args.opts or []), args.imports)
    if getattr(args, "checkpoint", None) is not None or args.command in _CHECKPOINT_WORDS:
        args.opts = _with_checkpoint(
            args.command, getattr(args, "checkpoint", None), list(args.opts or [])
        )
    if args.command == "eval" and args.out is not None:
        args.opts = [*args.opts, "TEST.OUT_DIR", args.out]


_CHECKPOINT_SUFFIXES = (".pth", ".pt", ".safetensors", ".ckpt")
_CHECKPOINT_WORDS = ("eval", "export", "calibrate")  # commands whose words are KEY VALUE pairs only


def _with_checkpoint(command: str, checkpoint: str | None, opts: list[str]) -> list[str]:
    """opts with --checkpoint PATH (timm's spelling) as MODEL.WEIGHTS
    PATH, the same thing; a bare checkpoint file among eval's or
    export's words is a UserError pointing at --checkpoint."""
    pairs = dict(zip(opts[0::2], opts[1::2]))
    if checkpoint is not None:
        given = pairs.get("MODEL.WEIGHTS")
        if given is not None and given.strip("'\"") != checkpoint:
            raise UserError(
                f"--checkpoint {checkpoint} and MODEL.WEIGHTS {given} name two files; give one of "
                "them"
            )
        return ["MODEL.WEIGHTS", checkpoint, *opts]
    if command in _CHECKPOINT_WORDS and len(opts) % 2:
        bare = [t for t in opts if t.endswith(_CHECKPOINT_SUFFIXES) and t not in pairs.values()]
        if bare:
            raise UserError(
                f"{command} takes the checkpoint as --checkpoint PATH (or MODEL.WEIGHTS PATH), not "
                f"as a bare word: distribuuuu {command} --checkpoint {bare[0]}"
            )
    return opts


def run(command: str, cfg_file: str | None, opts: list[str]) -> int:
    """Run train or eval in this process (any launcher); returns the
    exit status.

    The work is api.run_command's (the Python API runs the same); here
    only the statuses: 0, or 128 + signal after a preemption checkpoint,
    with one line. UserError and stop signals: see _guarded.
    """
    from distribuuuu.launch.signals import Preempted

    cfg = command_config(
        command, cfg_file, opts
    )  # before torch is imported: a bad key is a 0.2 s exit 2
    from distribuuuu import api

    try:
        api.run_command(command, cfg)
    except Preempted as stop:
        return _stopped(
            stop.signum, after=" after a checkpoint"
        )  # "ended by this signal", 128 + signal
    return 0


def command_config(command: str, cfg_file: str | None, opts: list[str]) -> Any:
    """train: --cfg and the overrides; eval: the same, or without --cfg
    the config stored with the checkpoint that MODEL.WEIGHTS (or
    OUT_DIR's best.pth) names (inference.load_config)."""
    if command == "eval":
        from distribuuuu import inference

        return inference.load_config(cfg_file, opts)
    from distribuuuu import config

    return config.load_config(cfg_file, opts)


def _spawn(
    command: str, cfg_file: str | None, opts: list[str], nproc: int, port: int | None
) -> int:
    """--nproc-per-node N: check once here, then start N processes that
    each run the command."""
    from distribuuuu import api, inferred, run_folder
    from distribuuuu.launch import launcher, spawn

    if launcher.detect().launcher != "plain":
        raise UserError(
            "--nproc-per-node starts its own processes; drop it when running under torchrun, "
            "torch.distributed.launch or srun"
        )
    cfg = inferred.resolve(
        command_config(command, cfg_file, opts), nproc
    )  # fail here, once, before any child starts
    new_folder, status = (
        not os.path.lexists(cfg.OUT_DIR),
        USER_ERROR_EXIT,
    )  # the checks make the folder
    try:
        api.check_before_start(command, cfg, nproc)
        relay = (
            cfg.TRAIN.PREEMPT_SIGNALS if command == "train" else ()
        )  # e.g. SIGUSR1: a checkpoint, not a kill
        status = spawn.spawn(
            _spawned, nproc, args=(command, cfg_file, opts), port=port, relay=relay
        )
    finally:  # a refused run takes a folder it made away again (an empty one only: rmdir)
        if new_folder and status == USER_ERROR_EXIT:
            run_folder.remove_if_empty(cfg.OUT_DIR)
    return status


def _spawned(command: str, cfg_file: str | None, opts: list[str]) -> None:
    """Entry point of each process started by --nproc-per-node
    (module-level: it is pickled)."""
    sys.exit(_guarded(lambda: run(command, cfg_file, opts)))


def _nproc(value: str) -> int:
    """--nproc-per-node N or 'auto'."""
    if value == "auto":
        import torch

        return torch.cuda.device_count() or os.cpu_count() or 1
    try:
        n = int(value)
    except ValueError:
        raise UserError(
            f"--nproc-per-node takes a positive integer or 'auto', got {value!r}"
        ) from None
    if n < 1:
        raise UserError(f"--nproc-per-node must be at least 1, got {n}")
    return n


def _other_command(args: argparse.Namespace) -> int:
    """plot, bench, predict, export, calibrate, data, config: each tool module
    (distribuuuu/tools/) is imported only when chosen; `distribuuuu
    --help` and train/eval load none of them."""
    opts = list(getattr(args, "opts", None) or [])
    if args.command == "plot":
        from distribuuuu.tools import plot

        return plot.main(args.run_dirs, args.out)
    if args.command == "bench":
        return _run_bench(args, opts)
    if args.command == "predict":
        from distribuuuu.tools import predict

        return predict.main(args.cfg_file, opts, args.topk, args.output, args.fmt, args.model)
    if args.command == "export":
        from distribuuuu.tools import export

        return export.main(args.cfg_file, opts, args.out, args.tol, args.batch, args.fmt)
    if args.command == "calibrate":
        from distribuuuu.tools import calibrate

        return calibrate.main(args.cfg_file, opts)
    return _run_data(args) if args.command == "data" else _print_config(args, opts)


def _print_config(args: argparse.Namespace, opts: list[str]) -> int:
    """`distribuuuu config`: the merged config as YAML, the unset keys
    decided from the data as one process would (inferred/); with
    --list the shipped configs, with --explain KEY one key."""
    from distribuuuu import config, inferred

    if args.explain is not None:
        print(cli_help.explain(args.explain), end="")
        return 0
    if args.list_shipped:
        if args.cfg_file or opts:
            raise UserError(
                "config --list lists the shipped configs; it takes no --cfg or KEY VALUE (drop "
                "them, or drop --list to print a merged config)"
            )
        from distribuuuu.config import shipped

        print(shipped.listing(), end="")
        return 0
    cfg = inferred.resolve(config.load_config(args.cfg_file, opts), 1)
    from distribuuuu import (
        strategies,
    )  # its rules too (they import torch: only here, after the keys passed)

    strategies.strategy_class(cfg.DIST.STRATEGY).check_config(cfg, world_size=1)
    print(cfg.dump(), end="")
    return 0


def _run_bench(args: argparse.Namespace, opts: list[str]) -> int:
    """bench: the one-process timings (tools/bench.py), --scaling
    (tools/scaling.py), --compare (tools/compare.py) or --io
    (tools/bench_io.py). The options are checked here, before the chosen
    module imports torch."""
    sweeps = [
        name
        for name, on in (
            ("--compare", args.compare is not None),
            ("--scaling", args.scaling is not None),
            ("--io", args.io),
        )
        if on
    ]
    if len(sweeps) > 1:
        raise UserError(f"{' and '.join(sweeps)} are different sweeps; give one of them")
    if args.compare is not None:
        from distribuuuu.tools import compare

        return compare.run_compare(
            args.cfg_file,
            opts,
            args.compare,
            2 if args.epochs is None else args.epochs,
            args.out,
            args.nproc,
            args.global_batch,
            args.amp,
        )
    if args.iters < 1 or args.warmup < 0:
        raise UserError(
            f"--iters must be at least 1 and --warmup at least 0, got {args.iters} and "
            f"{args.warmup}"
        )
    if args.scaling is not None:
        from distribuuuu.tools import scaling

        return scaling.main(
            args.cfg_file, opts, args.scaling, 1 if args.epochs is None else args.epochs, args.out
        )
    if args.io:
        if args.repeats < 1:
            raise UserError(f"--repeats must be at least 1, got {args.repeats}")
        from distribuuuu.tools import bench_io

        return bench_io.main(
            args.cfg_file,
            opts,
            args.workers,
            (args.iters, args.warmup, args.repeats),
            args.io_shards,
            args.out,
            args.io_tars,
        )
    from distribuuuu.tools import bench

    return bench.main(args.cfg_file, opts, args.iters, args.warmup, args.out)


def _run_data(args: argparse.Namespace) -> int:
    """`data export SOURCE DIR`, `data shard SRC DEST`, `data index DIR`
    or `data split RUN_DIR DEST`: one line per split written."""
    if args.data_command == "export":
        from distribuuuu import data

        counts = data.export(args.source, args.dest)
        print(
            f"wrote {args.source} to {args.dest}: "
            + ", ".join(f"{k} {v}" for k, v in counts.items())
        )
        return 0
    if args.data_command == "index":
        return _run_data_index(args)
    if args.data_command == "split":
        return _split_data(args.run_dir, args.dest)
    from distribuuuu.data import shards

    size = shards.parse_size(args.shard_size)
    for index in shards.write_shards(
        args.source, args.dest, shard_bytes=size, shard_samples=args.shard_samples, seed=args.seed
    ):
        s = shards.load_shard_set(str(index), "", "SRC")
        print(
            f"wrote {s.num_samples} images of {len(s.classes)} classes to {len(s.shards)} shard(s) "
            f"in {index.parent} ({sum(x.bytes for x in s.shards) / 2**20:.1f} MiB; index "
            f"{index.name})"
        )
    return 0


def _run_data_index(args: argparse.Namespace) -> int:
    """`data index DIR`: one line per split indexed."""
    from distribuuuu.data.shards import external

    for path, index, note in external.index_tars(args.source, args.image_field, args.label_field):
        print(
            f"indexed {index['num_samples']} samples of {len(index['classes'])} classes in "
            f"{len(index['shards'])} tar(s) (counts from {index['counted_by']}, labels from "
            f"{index['label_field']}): {path}"
        )
        if note:
            print(note)
    return 0


def _split_data(run_dir: str, dest: str) -> int:
    """`data split RUN_DIR DEST`: one line, the images of each part."""
    from distribuuuu.data import split_files

    counts = split_files.split_out(run_dir, dest)
    print(
        f"wrote the split of {run_dir} to {dest}: train {counts['train']}, val {counts['val']} "
        f"images of {counts['classes']} classes (symlinks to the run's images)"
    )
    return 0


def package_version() -> str:
    """The installed distribution's version; the package's own
    __version__ when run from a checkout that is not installed."""
    try:
        return importlib.metadata.version("distribuuuu")
    except importlib.metadata.PackageNotFoundError:
        from distribuuuu import __version__

        return __version__
