"""Slurm's compact notations: host lists ("node[01-04,07],gpu2") and
tasks per node ("2(x3),1").

Pure string functions, used by launch.launcher to find the master host
and the processes per node.
"""

from __future__ import annotations

import itertools
import re

from distribuuuu.errors import UserError


def _split_top_level(spec: str) -> list[str]:
    """Split on commas outside brackets: "a[1,3],b" -> ["a[1,3]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise UserError(f"hostlist {spec!r}: nested brackets are not valid")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UserError(f"hostlist {spec!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise UserError(f"hostlist {spec!r}: '[' without ']'")
    parts.append(spec[start:])
    return parts


def _expand_brackets(body: str, spec: str) -> list[str]:
    """ "01-03,07" -> ["01", "02", "03", "07"]; the width of the low end
    sets the zero padding."""
    out: list[str] = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise UserError(f"hostlist {spec!r}: bad range {item!r} in [{body}]")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise UserError(f"hostlist {spec!r}: range {item!r} runs backwards")
        out.extend(f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
    return out


def parse_hostlist(spec: str) -> list[str]:
    """Expand a Slurm hostlist: "node[01-04,07],gpu2" -> node01..node04,
    node07, gpu2.

    Zero padding is kept ("n[08-11]" -> n08, n09, n10, n11). Several
    bracket groups in one name give every combination in order
    ("r[1-2]n[3-4]" -> r1n3, r1n4, r2n3, r2n4), as scontrol does.
    Anything else (nested brackets, empty names, backward ranges) raises
    UserError.
    """
    hosts: list[str] = []
    for part in _split_top_level(spec.strip()):
        part = part.strip()
        if not part:
            raise UserError(f"hostlist {spec!r} has an empty host name")
        # Alternate literal text and bracket bodies: "r", "1-2", "n",
        # "3-4", "".
        pieces = re.split(r"\[([^\]]*)\]", part)
        choices = [[p] if i % 2 == 0 else _expand_brackets(p, spec) for i, p in enumerate(pieces)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's tasks-per-node notation: "2(x3),1" -> [2, 2, 2,
    1]."""
    counts: list[int] = []
    for item in spec.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise UserError(f"tasks-per-node {spec!r}: cannot read {item!r} (expected N or N(xM))")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
