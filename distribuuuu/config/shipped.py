"""The configs shipped inside the package (distribuuuu/configs/*.yaml;
the repository's config/ is a link to that folder, so there is one copy
of each): `--cfg NAME` finds one by name, from any folder, and
`distribuuuu config --list` lists them."""

from __future__ import annotations

import os

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# Folders a shipped config is reached through when the path given does
# not exist: none (a bare name), and the repository's config/ (the docs'
# `--cfg config/x.yaml`, typed in another folder).
_SHIPPED_PREFIXES = (".", "config")


def shipped_names() -> list[str]:
    """The shipped configs' names (file names without .yaml), sorted."""
    if not os.path.isdir(SHIPPED_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(SHIPPED_DIR) if f.endswith(".yaml"))


def first_comment(name: str) -> str:
    """The first sentence of a shipped config's leading comment (what
    the file is for), without `#`."""
    words: list[str] = []
    with open(os.path.join(SHIPPED_DIR, name + ".yaml"), encoding="utf-8") as f:
        for line in f:
            if not line.lstrip().startswith("#"):
                break
            words.append(line.strip().lstrip("#").strip())
    text = " ".join(w for w in words if w)
    # A sentence ends at ". " or at a colon that introduces a command
    # (the text before it is whole).
    for end in (". ", ":  ", ": distribuuuu"):
        if end in text:
            text = text[: text.index(end) + 1]
    return text.rstrip(":")


def resolve(cfg_file: str) -> str:
    """The file `--cfg cfg_file` means: an existing file as given (a
    path always wins); else the shipped config it names (`mnist5k_fast`,
    `mnist5k_fast.yaml`, `config/mnist5k_fast.yaml`); else cfg_file
    unchanged, for the caller's "does not exist" message."""
    if os.path.isfile(cfg_file):
        return cfg_file
    folder, base = os.path.split(cfg_file)
    name = base[:-5] if base.endswith(".yaml") else base
    if os.path.normpath(folder or ".") in _SHIPPED_PREFIXES and name in shipped_names():
        return os.path.join(SHIPPED_DIR, name + ".yaml")
    return cfg_file


def missing_message(cfg_file: str) -> str:
    """The error for a --cfg that is neither a file nor a shipped
    config's name."""
    names = ", ".join(shipped_names()) or "none (the package's configs/ folder is missing)"
    return (
        f"config file {cfg_file!r} does not exist and is not the name of a shipped config; pass a "
        f"YAML file or a shipped config by name, e.g. `--cfg mnist5k_fast` (shipped: {names}; "
        "`distribuuuu config --list` describes them)"
    )


def listing() -> str:
    """The text of `distribuuuu config --list`: each shipped config's
    name and first comment line."""
    names = shipped_names()
    width = max((len(n) for n in names), default=0)
    lines = [f"shipped configs (in {SHIPPED_DIR}); use one by name: distribuuuu train --cfg NAME"]
    lines += [f"  {n:<{width}}  {first_comment(n)}" for n in names]
    return "\n".join(lines) + "\n"
