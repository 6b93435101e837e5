"""The configuration: one yacs tree, every key with a one-line comment
(defaults.py).

``load_config(cfg_file, opts)`` = defaults -> merge the file -> merge
the ``KEY VALUE`` list -> ``validate`` -> freeze -> import the IMPORTS
modules. Reading files and overrides, and writing a config back out, is
in reading.py; the rules across keys (a table) in validate.py; the
user's modules in user_modules.py; the shipped configs in shipped.py.
Errors are ``UserError`` (exit status 2). The keys left for the data to
decide (0, '', -1) are resolved by ``inferred.resolve``, which the
callers that run something call (api.py, the CLI's spawner and `config`
command, the tools).
"""

from distribuuuu.config.reading import (
    CONFIG_DIFF,
    diff_from_defaults,
    flatten,
    get_defaults,
    load_config,
    merge_file,
    merge_opts,
    merge_text,
    parse_literal,
    unknown_key,
    with_imports,
)
from distribuuuu.config.user_modules import import_user_modules
from distribuuuu.config.validate import validate

__all__ = [
    "load_config",
    "get_defaults",
    "validate",
    "merge_file",
    "merge_opts",
    "merge_text",
    "diff_from_defaults",
    "flatten",
    "import_user_modules",
    "with_imports",
    "parse_literal",
    "unknown_key",
    "CONFIG_DIFF",
]
