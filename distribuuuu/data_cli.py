"""`distribuuuu data ...`: dataset utilities (export a built-in dataset as files, write tar shards).

Kept apart from cli.py so the command line parses without importing torch; each command imports its
data code when it runs.
"""

from __future__ import annotations

import argparse

from distribuuuu import cli_help


def add_parser(sub: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser]) -> None:
    """The `data` command and its subcommands `export` and `shard`."""
    data_parser = sub.add_parser("data", help="dataset utilities")
    data_sub = data_parser.add_subparsers(dest="data_command", required=True, parser_class=parser_class)
    data_sub.add_parser = cli_help.with_examples(data_sub.add_parser, "data ")  # type: ignore[method-assign]
    export = data_sub.add_parser("export", help="write a built-in dataset as an ImageFolder tree")
    export.add_argument("source", choices=["mnist5k"], metavar="SOURCE", help="the built-in dataset to write: mnist5k")
    export.add_argument("dest", help="output folder (gets train/<class>/*.png and val/<class>/*.png)")
    shard = data_sub.add_parser("shard", help="write an image folder (or mnist5k) as WebDataset tar shards "
                                "+ index.json (data/shards/write.py)")
    shard.add_argument("source", metavar="SRC", help="an image folder (<class>/<image>), a dataset root holding "
                       "train/ val/ [test/], or mnist5k")
    shard.add_argument("dest", metavar="DEST", help="output folder: DEST/<split>/<split>-000000.tar ... + index.json")
    shard.add_argument("--shard-size", dest="shard_size", default="256MB",
                       help="largest shard, in bytes with K/M/G (a shard holds at least one image)")
    shard.add_argument("--shard-samples", dest="shard_samples", type=int, default=None,
                       help="at most this many images per shard (default: no limit)")
    shard.add_argument("--seed", type=int, default=0, help="the one shuffle before writing (same seed, same bytes)")


def run(args: argparse.Namespace) -> int:
    """Run `data export` or `data shard`; a UserError goes up to the CLI's exit-2 handler."""
    if args.data_command == "shard":
        return _shard(args)
    from distribuuuu import data

    counts = data.export_mnist5k(args.dest)
    print(f"wrote {args.source} to {args.dest}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


def _shard(args: argparse.Namespace) -> int:
    """`data shard SRC DEST`: one line per split written."""
    from distribuuuu.data import shards

    size = shards.parse_size(args.shard_size)
    for index in shards.write_shards(args.source, args.dest, shard_bytes=size, shard_samples=args.shard_samples,
                                     seed=args.seed):
        s = shards.load_shard_set(str(index), "", "SRC")
        print(f"wrote {s.num_samples} images of {len(s.classes)} classes to {len(s.shards)} shard(s) "
              f"in {index.parent} ({sum(x.bytes for x in s.shards) / 2**20:.1f} MiB; index {index.name})")
    return 0
