"""The configuration: one yacs tree, every key with a one-line comment (defaults.py).

Call order: ``load_config(cfg_file, opts)`` = defaults -> merge file -> merge ``KEY VALUE`` list
-> ``validate`` -> freeze -> import the IMPORTS modules. Reading files and overrides is in
reading.py, the semantic checks in validate.py, the user's modules in user_modules.py. Errors are
``UserError`` (exit status 2).
"""

from __future__ import annotations

import os
from typing import Any

import yaml
from yacs.config import CfgNode as CN

from distribuuuu import inferred
from distribuuuu.config.defaults import get_defaults
from distribuuuu.config.reading import flatten, merge_file, merge_opts, merge_text, parse_literal
from distribuuuu.config.user_modules import import_user_modules
from distribuuuu.config.validate import validate

CONFIG_DIFF = "config_diff.yaml"  # in OUT_DIR: the keys a run sets that differ from the defaults

__all__ = ["load_config", "get_defaults", "validate", "merge_file", "merge_opts", "merge_text", "dump_to_run_folder",
           "diff_from_defaults", "to_yaml", "flatten", "import_user_modules", "with_imports"]


def load_config(cfg_file: str | None = None, opts: list[str] | None = None) -> CN:
    """Defaults, then the file, then the overrides; validated and frozen. The IMPORTS modules are
    imported next, so whatever builds the model or the data afterwards finds what they register;
    last the keys left unset are decided from the data (inferred.py)."""
    cfg = get_defaults()
    if cfg_file:
        merge_file(cfg, cfg_file)
    merge_opts(cfg, list(opts or []))
    validate(cfg)
    cfg.freeze()
    import_user_modules(cfg.IMPORTS)
    return inferred.resolve(cfg)  # the unset keys from the data, once (after IMPORTS: a user's source counts)


def with_imports(cfg_file: str | None, opts: list[str], modules: list[str]) -> list[str]:
    """opts with ``modules`` (the CLI's --import) added to IMPORTS: to an IMPORTS override in opts,
    else to the IMPORTS of cfg_file, as an ``IMPORTS [...]`` pair put first."""
    opts = list(opts)
    if not modules:
        return opts
    for i in range(0, len(opts) - 1, 2):
        if opts[i] == "IMPORTS":  # an explicit override: --import adds to it
            given = parse_literal(opts[i + 1])
            opts[i + 1] = repr(list(dict.fromkeys([*(given if isinstance(given, list) else [given]), *modules])))
            return opts
    cfg = get_defaults()
    if cfg_file:
        merge_file(cfg, cfg_file)
    return ["IMPORTS", repr(list(dict.fromkeys([*cfg.IMPORTS, *modules]))), *opts]


def diff_from_defaults(cfg: CN) -> dict[str, Any]:
    """Flat {KEY: value} of the keys whose value differs from the default."""
    defaults = flatten(get_defaults())
    return {k: v for k, v in flatten(cfg).items() if defaults.get(k) != v}


def to_yaml(cfg: CN) -> str:
    """The whole config as YAML (what OUT_DIR/config.yaml holds)."""
    return cfg.dump()


def dump_to_run_folder(cfg: CN, out_dir: str) -> None:
    """Write the full config (CFG_DEST) and the diff from the defaults (config_diff.yaml)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, cfg.CFG_DEST), "w") as f:
        f.write(to_yaml(cfg))
    nested: dict[str, Any] = {}
    for key, value in diff_from_defaults(cfg).items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    with open(os.path.join(out_dir, CONFIG_DIFF), "w") as f:
        yaml.safe_dump(nested, f, sort_keys=True)
