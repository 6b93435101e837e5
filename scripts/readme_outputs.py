#!/usr/bin/env python
"""Run the commands of the README and of the docs pages it leads to, and regenerate (or check) the
output blocks they show.

    .venv/bin/python scripts/readme_outputs.py            # run everything, report drift (exit 1 on any)
    .venv/bin/python scripts/readme_outputs.py --write    # ... and rewrite the output blocks (make readme)
    .venv/bin/python scripts/readme_outputs.py --lint     # only check that every block is marked (fast)

The documents are DOCUMENTS below, in that order: README.md first, then the docs pages whose code
blocks carry markers. Every command runs in ONE new folder outside the repository (kept with --keep),
in document order, with `distribuuuu` and `python` taken from this interpreter's folder (the installed
command), as a new user would type them there. tests/test_readme.py runs the same code, so the
documents cannot drift.

How to add a command (or a section with code) to one of the documents:
  1. put one of the markers below on the line just before each code block: an HTML comment that
     GitHub does not show. Every ```bash and ```python block, and every block that starts with
     `$ `, must carry one: tests/test_readme.py (in `make test-fast`) fails on a block without one,
     and on a skip without a reason. Plain ``` blocks of other text (a layout) need none.
  2. a command that cannot run on a CPU in a minute or so, from an empty folder, without the
     network: `readme:skip` with the reason (a GPU, ImageNet, Slurm, a download, a placeholder).
  3. to show what a command prints, use an output block, not pasted text; then `make readme`
     (this script with --write) fills it in, and `--lint` checks the markers in a second.

    <!-- readme:run -->            run each command of the block (a ```bash block: one command a line,
                                   `\\` continues a line, `#` comments dropped; a ```python block: the
                                   whole block as one script); each must exit 0. `id=NAME` keeps the
                                   output for an output block (below).
    <!-- readme:file path=F -->    write the block's text to the file F of the folder (a module that a
                                   later command imports); nothing runs.
    <!-- readme:output -->         a block of `$ COMMAND` lines, each followed by what it prints: the
                                   command runs and the lines under it are regenerated. Options:
                                   `status=N` (the exit status it must end with, 0 unless given),
                                   `grep=REGEX` (show only the matching lines),
                                   `from=REGEX` (show from the first matching line on).
    <!-- readme:output of=NAME grep=REGEX -->   the block is an excerpt of what the `run id=NAME`
                                   block printed (no `$` line); `grep`/`from` as above. Filled in
                                   after every command ran, so it may stand before that block.
    <!-- readme:skip reason="..." -->  not run; the reason (needs a GPU, ImageNet, Slurm, a download;
                                   or: what runs the same thing) is printed by the test.

Options are KEY=VALUE, a value with spaces in double quotes, as in a shell (`grep="^a|b c"`).

Commands run one after another and share the folder, so a later one can read what an earlier one
wrote (the demo's run folder, made by the README, is used by the docs pages after it). Keep what the
documents run small: the whole test has a budget of about 3 minutes on 2 cores (a command that takes longer is shown smaller, or skipped with a reason).

Volatile parts: the output blocks hold what a real run printed (timings, img/s, accuracies, ports,
clock times, as produced on the machine that ran --write), with the run's folder shown as `.` and
the repository as `<repo>`. The check compares structure, not values: each line with every number
replaced by `#` and runs of spaces squeezed, blank lines dropped. So a new column, a renamed line, a
line more or less fails the check; 97.9% instead of 98.9% does not (what a run must reach is the
business of the tests that train).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# The documents whose blocks run, in the order they run (paths relative to ROOT). A page added here must be
# linked from the README's "Where to go next" (tests/test_readme.py checks it).
DOCUMENTS = ("README.md", "docs/tour.md", "docs/configuration.md", "docs/run-folder.md", "docs/data-formats.md")
MARKER = re.compile(r"^<!--\s*readme:(\w+)\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")
KINDS = {"run": {"id"}, "file": {"path"}, "output": {"of", "status", "grep", "from"}, "skip": {"reason"}}
COMMAND_TIMEOUT_S = 300


@dataclass
class Block:
    """One fenced code block of a document and the marker above it."""

    line: int  # 1-based line of the opening fence
    lang: str
    body: list[str]
    kind: str = ""  # "" when unmarked
    opts: dict[str, str] = field(default_factory=dict)
    marker_error: str = ""
    source: str = "README.md"

    def where(self) -> str:
        """The document and line of the block's opening fence: `docs/tour.md:12`."""
        return f"{self.source}:{self.line}"

    @property
    def key(self) -> tuple[str, int]:
        """What names the block among all documents' blocks: (document, line)."""
        return (self.source, self.line)


@dataclass
class Result:
    """What one command did."""

    block: Block
    command: str
    status: int
    output: str
    seconds: float


def parse(text: str, source: str = "README.md") -> list[Block]:
    """The fenced blocks of a markdown text, each with the `<!-- readme:... -->` marker just above it."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        block = Block(line=i + 1, lang=match.group(1), body=lines[i + 1:end], source=source)
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        if marker:
            block.kind = marker.group(1)
            try:
                block.opts = dict(_option(word) for word in shlex.split(marker.group(2)))
            except ValueError as e:
                block.marker_error = f"cannot read the marker's options ({e})"
        blocks.append(block)
        i = end + 1
    return blocks


def _option(word: str) -> tuple[str, str]:
    if "=" not in word:
        raise ValueError(f"{word!r} is not KEY=VALUE")
    key, value = word.split("=", 1)
    return key, value


def needs_marker(block: Block) -> bool:
    """A block that a reader could type: a bash or python block, or a `$ command` transcript."""
    typed = block.lang in ("bash", "sh", "shell", "console", "python")
    return typed or bool(block.body) and block.body[0].startswith("$ ")


def read_documents(documents: tuple[str, ...] | list[str] = DOCUMENTS, root: str = ROOT) -> dict[str, str]:
    """The text of each document, by its path relative to root (or its own path, when absolute), in order."""
    texts = {}
    for path in documents:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            texts[path] = f.read()
    return texts


def parse_all(texts: dict[str, str]) -> list[Block]:
    """The blocks of every document, in document order: what runs, in the order it runs."""
    return [block for source, text in texts.items() for block in parse(text, source)]


def lint(blocks: list[Block]) -> list[str]:
    """One line per block whose run/skip decision is missing or malformed (empty when all is well)."""
    problems, first = [], {}
    for b in (b for b in blocks if b.kind == "run" and b.opts.get("id")):
        if b.opts["id"] in first:
            problems.append(f"{b.where()}: readme:run id={b.opts['id']} is used twice (first at "
                            f"{first[b.opts['id']].where()})")
        first.setdefault(b.opts["id"], b)
    ids = set(first)
    for b in blocks:
        if not b.kind:
            if needs_marker(b):
                problems.append(f"{b.where()}: ```{b.lang} block without a readme:run/file/output/skip marker")
            continue
        problems += [f"{b.where()}: {p}" for p in _marker_problems(b, ids)]
    return problems


def _marker_problems(b: Block, ids: set) -> list[str]:
    if b.marker_error:
        return [b.marker_error]
    if b.kind not in KINDS:
        return [f"unknown marker readme:{b.kind} (use one of {', '.join(KINDS)})"]
    unknown = sorted(set(b.opts) - KINDS[b.kind])
    if unknown:
        return [f"readme:{b.kind} takes no option {', '.join(unknown)} (it takes {', '.join(sorted(KINDS[b.kind]))})"]
    if b.kind == "skip" and not b.opts.get("reason", "").strip():
        return ['readme:skip without a reason: write reason="why this cannot run in the test"']
    if b.kind == "run" and b.lang not in ("bash", "python"):
        return [f"readme:run on a ```{b.lang} block: only bash and python blocks run"]
    if b.kind == "file" and not b.opts.get("path"):
        return ["readme:file without path=FILE"]
    if b.kind == "output" and "of" in b.opts and b.opts["of"] not in ids:
        return [f"readme:output of={b.opts['of']}: no readme:run block has id={b.opts['of']}"]
    if b.kind == "output" and "of" not in b.opts and not (b.body and b.body[0].startswith("$ ")):
        return ["readme:output block neither starts with `$ COMMAND` nor names of=ID"]
    return []


def bash_commands(body: list[str]) -> list[str]:
    """The commands of a bash block: `\\`-continued lines joined, blank and comment lines dropped."""
    commands, pending = [], ""
    for raw in body:
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        commands.append(pending + line)
        pending = ""
    return commands


def transcript(body: list[str]) -> list[tuple[str, list[str]]]:
    """A `$ COMMAND` block as (command, the output lines shown under it) pairs."""
    pairs: list[tuple[str, list[str]]] = []
    for line in body:
        if line.startswith("$ "):
            pairs.append((line[2:].strip(), []))
        elif pairs:
            pairs[-1][1].append(line)
    return pairs


def command_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment commands run in: this interpreter's folder (a venv's bin/) first on PATH, so
    `distribuuuu` and `python` are the installed ones; output unbuffered, so that the lines of
    several processes arrive in the order they were printed."""
    env = dict(os.environ if base is None else base)
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    env.update(PATH=os.pathsep.join([bindir, env.get("PATH", "")]), PYTHONUNBUFFERED="1")
    return env


def run_command(block: Block, command: str, folder: str, env: dict[str, str], script: str | None = None) -> Result:
    """Run one command (through bash) or one python script (on stdin) in folder: its status and output
    (stdout and stderr interleaved, as a terminal shows them), with the folder's path shown as `.`."""
    args = ["python", "-"] if script is not None else ["bash", "-c", command]
    start = time.monotonic()
    try:
        proc = subprocess.run(args, cwd=folder, env=env, input=script, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT_S)
        status, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        status, output = -1, f"{e.output or ''}\n(killed after {COMMAND_TIMEOUT_S} s)"
    return Result(block, command, status, _portable(output, folder), time.monotonic() - start)


def _portable(text: str, folder: str) -> str:
    """Paths that name this machine made neutral: the run's folder -> `.`, the repository -> `<repo>`."""
    real = os.path.realpath(folder)
    for path in sorted({folder, real}, key=len, reverse=True):
        text = text.replace(path + os.sep, "").replace(path, ".")
    return text.replace(ROOT, "<repo>")


def excerpt(output: str, opts: dict[str, str]) -> list[str]:
    """The lines of output an output block shows: from the first `from` match on, those matching `grep`."""
    lines = output.rstrip("\n").splitlines()
    if "from" in opts:
        first = next((i for i, ln in enumerate(lines) if re.search(opts["from"], ln)), len(lines))
        lines = lines[first:]
    if "grep" in opts:
        lines = [ln for ln in lines if re.search(opts["grep"], ln)]
    return [ln.rstrip() for ln in lines]


def normalise(lines: list[str]) -> list[str]:
    """The structure of output lines: every number -> `#`, runs of spaces squeezed, blank lines dropped."""
    squeezed = (" ".join(re.sub(r"\d+(?:\.\d+)?", "#", ln).split()) for ln in lines)
    return [ln for ln in squeezed if ln]


@dataclass
class Report:
    """What running the documents did: every command's result, the blocks skipped, the fresh text of
    every output block (by its Block.key: document and fence line), and what went wrong."""

    results: list[Result] = field(default_factory=list)
    skipped: list[Block] = field(default_factory=list)
    generated: dict[tuple[str, int], list[tuple[str | None, list[str]]]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    drift: list[str] = field(default_factory=list)


def run_readme(blocks: list[Block], folder: str, env: dict[str, str] | None = None,
               say=print) -> Report:
    """Run the marked blocks (of one document or several) in order in folder, fill in the output blocks
    and compare them with the text."""
    report, outputs, env = Report(), {}, command_env(env)
    for block in blocks:
        if block.kind == "skip":
            report.skipped.append(block)
            say(f"[readme] {block.where()} skipped: {block.opts['reason']}")
        elif block.kind == "file":
            with open(os.path.join(folder, block.opts["path"]), "w", encoding="utf-8") as f:
                f.write("\n".join(block.body) + "\n")
        elif block.kind == "run":
            text = "".join(_run_block(block, folder, env, report, say))
            outputs[block.opts.get("id")] = text
        elif block.kind == "output" and "of" not in block.opts:
            _run_transcript(block, folder, env, report, say)
    for block in blocks:  # excerpts of run blocks: those ran above, wherever the excerpt stands
        if block.kind == "output" and "of" in block.opts:
            report.generated[block.key] = [(None, excerpt(outputs.get(block.opts["of"], ""), block.opts))]
    report.drift = [d for b in blocks if b.key in report.generated for d in _drift(b, report.generated[b.key])]
    return report


def _run_block(block: Block, folder: str, env: dict[str, str], report: Report, say) -> list[str]:
    if block.lang == "python":
        steps = [("python block", "\n".join(block.body) + "\n")]
    else:
        steps = [(command, None) for command in bash_commands(block.body)]
    outputs = []
    for command, script in steps:
        result = _record(run_command(block, command, folder, env, script), 0, report, say)
        outputs.append(result.output)
    return outputs


def _run_transcript(block: Block, folder: str, env: dict[str, str], report: Report, say) -> None:
    fresh = []
    for command, _ in transcript(block.body):
        result = _record(run_command(block, command, folder, env), int(block.opts.get("status", 0)), report, say)
        fresh.append((command, excerpt(result.output, block.opts)))
    report.generated[block.key] = fresh


def _record(result: Result, wanted: int, report: Report, say) -> Result:
    report.results.append(result)
    say(f"[readme] {result.block.where()} $ {result.command.splitlines()[0]}  -> exit {result.status} "
        f"({result.seconds:.1f} s)")
    if result.status != wanted:
        report.failures.append(f"{result.block.where()}: `{result.command}` exited {result.status} (wanted "
                               f"{wanted}); its output ends:\n{result.output[-3000:]}")
    return result


def shown(block: Block) -> list[tuple[str | None, list[str]]]:
    """What an output block shows now, in the shape of Report.generated."""
    if "of" in block.opts:
        return [(None, block.body)]
    return [(command, lines) for command, lines in transcript(block.body)]


def _drift(block: Block, fresh: list[tuple[str | None, list[str]]]) -> list[str]:
    """A unified diff of the structure (normalise) per part of an output block that changed."""
    problems = []
    for (command, old), (_, new) in zip(shown(block), fresh):
        if normalise(old) != normalise(new):
            diff = "\n".join(difflib.unified_diff(normalise(old), normalise(new), block.source, "now", lineterm=""))
            problems.append(f"{block.where()}: the output of `{command or block.opts['of']}` changed "
                            f"(numbers shown as #):\n{diff}")
    return problems


def rewrite(text: str, blocks: list[Block], generated: dict[tuple[str, int], list[tuple[str | None, list[str]]]],
            source: str | None = None) -> str:
    """text (one document) with each generated output block's body replaced by its fresh lines. With
    several documents' blocks, source names the text's document: the others' blocks are not its own."""
    lines = text.splitlines()
    mine = [b for b in blocks if b.key in generated and source in (None, b.source)]
    for block in sorted(mine, key=lambda b: b.line, reverse=True):
        body = []
        for command, fresh in generated[block.key]:
            body += ([f"$ {command}"] if command else []) + fresh
        lines[block.line:block.line + len(block.body)] = body
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite the output blocks whose structure changed (numbers aside) from this run")
    parser.add_argument("--all", action="store_true",
                        help="with --write: rewrite every output block, also where only numbers changed")
    parser.add_argument("--lint", action="store_true", help="only check the markers; run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the folder the commands ran in")
    parser.add_argument("--doc", "--readme", dest="docs", action="append", metavar="FILE",
                        help="a markdown file to run instead of the documents (repeatable, run in the order "
                             f"given; default: {', '.join(DOCUMENTS)})")
    args = parser.parse_args(argv)
    if args.docs:
        texts = {os.path.basename(p) if not _inside(p) else os.path.relpath(p, ROOT): _read(p) for p in args.docs}
    else:
        texts = read_documents()
    blocks = parse_all(texts)
    problems = lint(blocks)
    if problems or args.lint:
        print("\n".join(problems) or f"{', '.join(texts)}: every block is marked")
        return 1 if problems else 0
    folder = tempfile.mkdtemp(prefix="readme-")
    try:
        report = run_readme(blocks, folder)
    finally:
        if args.keep:
            print(f"[readme] commands ran in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    if args.write and not report.failures:
        # Only what drifted, by default: figures from a quiet machine are not replaced by a busy one's.
        by_key = {b.key: b for b in blocks}
        fresh = {key: g for key, g in report.generated.items() if args.all or _drift(by_key[key], g)}
        paths = dict(zip(texts, args.docs or [os.path.join(ROOT, d) for d in texts]))
        for source, text in texts.items():
            mine = [b for b in blocks if b.source == source]
            new = rewrite(text, blocks, fresh, source)
            if new != text:
                with open(paths[source], "w", encoding="utf-8") as f:
                    f.write(new)
            print(f"[readme] rewrote {sum(b.key in fresh for b in mine)} of "
                  f"{sum(b.key in report.generated for b in mine)} output blocks of {source}")
    for problem in report.failures + ([] if args.write else report.drift):
        print(problem, file=sys.stderr)
    return 1 if report.failures or (report.drift and not args.write) else 0


def _inside(path: str) -> bool:
    return os.path.abspath(path).startswith(ROOT + os.sep)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


if __name__ == "__main__":
    sys.exit(main())
