"""Every `distribuuuu` command written in the README and docs/*.md parses: its subcommand and options
exist, and its --cfg and KEY VALUE overrides make a valid config. The README's commands also run
(tests/test_readme.py); the docs' ones mostly need ImageNet or GPUs, so they are checked, not run."""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest

from distribuuuu import cli, config
from distribuuuu.errors import UserError
from tests.conftest import ROOT

SHELL = ("", "bash", "sh", "console")


def _shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks marked bash, sh, console or nothing."""
    blocks, body, language = [], None, ""
    for line in text.splitlines():
        fence = line.strip()
        if body is None and fence.startswith("```"):
            body, language = [], fence[3:].strip()
        elif body is not None and fence == "```":
            if language in SHELL:
                blocks.append("\n".join(body))
            body = None
        elif body is not None:
            body.append(line)
    return blocks


def _commands() -> list[tuple[str, str]]:
    """(file, command) of each `distribuuuu ...` line of a shell block (continuations joined), and of
    each `train_net.py ARGS` / `test_net.py ARGS` under any launcher, as `distribuuuu train|eval ARGS`."""
    found = []
    for path in ["README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT))]:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for block in _shell_blocks(text):
            for name, words in re.findall(r"^(\w+)=\((.*?)\)$", block, re.S | re.M):  # bash arrays, as used
                block = block.replace(f'"${{{name}[@]}}"', " ".join(words.split()))
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ").removesuffix("&").strip()
                if "..." in line:  # a placeholder for the user's own values (`--cfg ...`): nothing to check
                    continue
                if line.startswith(("distribuuuu ", ".venv/bin/distribuuuu ")):
                    found.append((path, line))
                for script, command in (("train_net.py", "train"), ("test_net.py", "eval")):
                    rest = line.split(f"{script} ", 1)[1].strip() if f"{script} " in line else ""
                    if rest.startswith("--") or re.match(r"[A-Z]+\.[A-Z_]+ ", rest):  # not a file listing
                        found.append((path, f"distribuuuu {command} {rest}"))
    return found


COMMANDS = _commands()


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) >= 20 and {p for p, _ in COMMANDS} >= {"README.md", "docs/data-at-scale.md"}


# Commands written to show an error: they must keep failing.
SHOWN_FAILING = ("MODEL.ARHC",)


@pytest.mark.parametrize("path,line", COMMANDS, ids=[f"{p}:{i}" for i, (p, _) in enumerate(COMMANDS)])
def test_a_documented_command_parses(path, line):
    if any(word in line for word in SHOWN_FAILING):
        with pytest.raises(UserError):
            _parse(line)
        return
    _parse(line)


def _parse(line: str) -> None:
    argv = shlex.split(line, comments=True)[1:]
    if argv[:1] in (["--version"], []):
        return
    argv = cli.arrange(argv)  # options after the KEY VALUE pairs, as the command takes them
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as e:  # --help exits 0 after printing; a bad option exits 2
        assert e.code == 0, f"`{line}` does not parse"
        return
    if args.command in ("train", "eval", "bench", "config") and not getattr(args, "list", False):
        cwd = os.getcwd()
        os.chdir(ROOT)  # --cfg config/NAME.yaml is written relative to the checkout
        try:
            config.load_config(args.cfg_file, list(args.opts or []))
        finally:
            os.chdir(cwd)
