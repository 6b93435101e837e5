"""Reading a config: ``load_config`` (defaults -> the file -> the ``KEY
VALUE`` overrides -> validate.py's rules -> freeze -> the IMPORTS
modules), every key name and value type checked against the defaults;
YAML files in their encodings and with the mistakes people make; and
writing a config back out. Errors are ``UserError`` (exit status 2). The
keys left unset for the data to decide stay unset here: inferred/
resolves them where the data and the processes are known.
"""

from __future__ import annotations

import ast
import codecs
import difflib
import os
import re
from collections.abc import Iterable
from typing import Any

import yaml
from yacs.config import CfgNode as CN

from distribuuuu.config import shipped
from distribuuuu.config.defaults import _C, EITHER_TYPES, NULLABLE_TYPES
from distribuuuu.config.user_modules import import_user_modules
from distribuuuu.config.validate import validate
from distribuuuu.errors import UserError

CONFIG_DIFF = "config_diff.yaml"  # in OUT_DIR: the keys a run sets that differ from the defaults
# set on a config whose file's TEST.DATASET load_config dropped
# (inferred/)
TEST_FOLLOWED = "_test_followed_train"


def load_config(cfg_file: str | None = None, opts: list[str] | None = None) -> CN:
    """Defaults, then the file, then the overrides; validated and
    frozen. The IMPORTS modules are imported last, so whatever builds
    the model or the data afterwards finds what they register."""
    cfg = get_defaults()
    if cfg_file:
        merge_file(cfg, cfg_file)
    file_data = (cfg.TRAIN.DATASET, cfg.TEST.DATASET)
    merge_opts(cfg, list(opts or []))
    if (
        cfg.TEST.DATASET
        and cfg.TRAIN.DATASET != file_data[0]
        and "TEST.DATASET" not in (opts or [])[0::2]
    ):
        _test_follows_train(cfg, *file_data, opts or [])
    validate(cfg)
    cfg.freeze()
    if cfg.IMPORTS:
        import_user_modules(cfg.IMPORTS)
    return cfg


def _test_follows_train(cfg: CN, file_train: str, file_test: str, opts: list[str]) -> None:
    """The command line replaced the config file's TRAIN.DATASET and
    left its TEST.DATASET: that one was chosen for the file's own data
    (mnist5k_fast's mnist5k), and a model of the user's classes would be
    scored on it without a word. TEST.DATASET follows TRAIN.DATASET
    instead ('': its TEST.SPLIT, or the part TRAIN.VAL_SPLIT holds out
    of a folder of class folders), with a setup line (inferred/)."""
    cfg.TEST.DATASET = ""
    if "TEST.SPLIT" not in opts[0::2]:
        cfg.TEST.SPLIT = _C.TEST.SPLIT
    cfg.__dict__[TEST_FOLLOWED] = (file_test, file_train)


def get_defaults() -> CN:
    """A fresh, mutable copy of the default config (defaults.py)."""
    return _C.clone()


def merge_opts(cfg: CN, opts: list[str]) -> None:
    """Merge a ``KEY VALUE KEY VALUE ...`` list; values are parsed as
    Python literals."""
    if len(opts) % 2:
        raise UserError(
            f"overrides come in KEY VALUE pairs, but {len(opts)} words were given: "
            f"{' '.join(opts)!r}"
        )
    _set(
        cfg,
        [(opts[i], parse_literal(opts[i + 1])) for i in range(0, len(opts), 2)],
        "the command line",
    )


def flatten(node: CN, prefix: str = "") -> dict[str, Any]:
    """{"OPTIM.BASE_LR": 0.1, ...}: every leaf of a config tree under
    its full dotted name."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        full = f"{prefix}{key}"
        if isinstance(value, CN):
            out.update(flatten(value, full + "."))
        else:
            out[full] = value
    return out


def _flatten_plain(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            out.extend(_flatten_plain(value, full + "."))
        else:
            out.append((full, value))
    return out


def _type_name(t: type) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list"}.get(t, t.__name__)


def _coerce(key: str, value: Any, default: Any, source: str) -> Any:
    """value as the type of the key's default (an int for a float key, a
    tuple for a list), or a UserError."""
    if (
        key in EITHER_TYPES
        or value is None
        or (NULLABLE_TYPES.get(key) is str and str(value).lower() in _NONE_WORDS)
    ):
        return _either_or_none(key, value, default, source)
    expected = NULLABLE_TYPES.get(key, type(default))
    if isinstance(value, tuple):
        value = list(value)
    if (
        expected is float
        and not isinstance(value, bool)
        and (
            isinstance(value, int)
            or (isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()))
        )
    ):
        value = float(
            value
        )  # 1 is a fine float; YAML 1.1 reads 1e-3 (no dot) as text, and people mean the number
    if isinstance(value, expected) and not (
        expected is int and isinstance(value, bool)
    ):  # True is not a count
        return value
    raise UserError(
        f"config key {key} expects {_a(_type_name(expected))}, got {value!r} "
        f"({_type_name(type(value))}) from {source}"
    )


def _either_or_none(key: str, value: Any, default: Any, source: str) -> Any:
    """A key that takes either of two types (EITHER_TYPES:
    MODEL.PRETRAINED, True/False or a path), or None: fine for the keys
    of NULLABLE_TYPES (a text one also takes 'none', 'null' and ''),
    else a UserError."""
    if key in EITHER_TYPES:
        if isinstance(value, EITHER_TYPES[key]):
            return value
        raise UserError(
            f"config key {key} expects "
            f"{' or '.join(_a(_type_name(t)) for t in EITHER_TYPES[key])}, got {value!r} "
            f"({_type_name(type(value))}) from {source}"
        )
    if key in NULLABLE_TYPES:
        return None
    raise UserError(
        f"config key {key} cannot be None ({source}); expected {_a(_type_name(type(default)))}"
    )


_NONE_WORDS = ("none", "null", "")
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def parse_literal(text: str) -> Any:
    """Command-line values are Python literals; anything else is a plain
    string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _set(cfg: CN, pairs: Iterable[tuple[str, Any]], source: str) -> None:
    known = flatten(_C)
    for key, value in pairs:
        if key not in known:
            raise UserError(f"{unknown_key(key, known)} in {source}")
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = _coerce(key, value, known[key], source)


def unknown_key(key: str, known: Iterable[str]) -> str:
    """ "unknown config key KEY", with the closest known key as a
    suggestion."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = (
        f" (did you mean {close[0]}?)" if close else " (run `distribuuuu config` to list the keys)"
    )
    return f"unknown config key {key}{hint}"


# Byte-order marks and their codecs; the UTF-32 ones first (UTF-32 LE's
# begins with UTF-16 LE's).
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_MAX_CFG_BYTES = 16 << 20  # far above any config; a bigger --cfg is some other file
# Leading bytes of files that users pass to --cfg by mistake
_MAGIC = (
    (b"PK\x03\x04", "a zip archive (a PyTorch checkpoint?)"),
    (b"\x80", "a pickle (a PyTorch checkpoint?)"),
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"\x1f\x8b", "gzip data"),
    (b"\x7fELF", "a program"),
)


def _looks_like(raw: bytes) -> str:
    """A guess at what a file that is not UTF-8 YAML text is, for the
    error message."""
    for magic, what in _MAGIC:
        if raw.startswith(magic):
            return what
    head = raw[:4096]
    if len(head) >= 4 and head[1::2].count(0) > len(head) // 4:
        return "UTF-16 text without a byte-order mark"
    return "binary data" if b"\x00" in head else "text in another encoding (e.g. Latin-1)"


def _read_text(path: str) -> str:
    """The text of a config file: UTF-8, or UTF-8/16/32 with a
    byte-order mark (what Windows editors and PowerShell's `>` write).
    Anything else is a UserError saying what it looks like."""
    with open(path, "rb") as f:
        raw = f.read(_MAX_CFG_BYTES + 1)
    fix = "save it as UTF-8 text, or pass a YAML file such as config/resnet18.yaml"
    if len(raw) > _MAX_CFG_BYTES:
        raise UserError(
            f"config file {path!r} is larger than {_MAX_CFG_BYTES >> 20} MiB, so it is not a YAML "
            f"config (it looks like {_looks_like(raw)}); pass a YAML file such as "
            "config/resnet18.yaml"
        )
    codec = next((c for bom, c in _BOMS if raw.startswith(bom)), "utf-8")
    try:
        text = raw.decode(codec)
    except UnicodeDecodeError as e:
        raise UserError(
            f"config file {path!r} is not {codec.upper().replace('-SIG', '')} YAML text (byte "
            f"0x{raw[e.start]:02x} at offset {e.start}; it looks like {_looks_like(raw)}); {fix}"
        ) from None
    if (
        "\x00" in text
    ):  # valid UTF-8, but YAML text never holds NUL: UTF-16 without a BOM, or binary
        raise UserError(
            f"config file {path!r} is not UTF-8 YAML text (NUL bytes; it looks like "
            f"{_looks_like(raw)}); {fix}"
        )
    return text


def merge_file(cfg: CN, path: str) -> None:
    """Merge a YAML file into cfg, checking every key and type. path is
    a file, or the name of a shipped config (see shipped.resolve: a file
    that exists wins)."""
    path = shipped.resolve(path)
    if os.path.isdir(path):
        raise UserError(
            f"config file {path!r} is a folder; pass --cfg with a YAML file such as "
            "config/resnet18.yaml"
        )
    if not os.path.isfile(path):
        raise UserError(shipped.missing_message(path))
    _merge_yaml(cfg, _read_text(path), f"config file {path!r}", f"config file {path}")


def merge_text(cfg: CN, text: str, source: str) -> None:
    """Merge YAML text (e.g. the config stored in a checkpoint) into
    cfg, checking every key and type as for a file; unlike yacs's
    merge_from_other_cfg, it takes a MODEL.PRETRAINED path."""
    _merge_yaml(cfg, text, source, source)


def _merge_yaml(cfg: CN, text: str, source: str, plain_source: str) -> None:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{source} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{source} must hold a mapping of KEY: value, not {type(data).__name__}")
    _set(cfg, _flatten_plain(data), plain_source)


# ---------------------------------------------------------------------------------------------
# Writing a config back out, and the CLI's --import
# ---------------------------------------------------------------------------------------------
def diff_from_defaults(cfg: CN) -> dict[str, Any]:
    """Flat {KEY: value} of the keys whose value differs from the
    default."""
    defaults = flatten(_C)
    return {k: v for k, v in flatten(cfg).items() if defaults.get(k) != v}


def with_imports(cfg_file: str | None, opts: list[str], modules: list[str]) -> list[str]:
    """opts with ``modules`` (the CLI's --import) added to IMPORTS: to
    an IMPORTS override in opts, else to the IMPORTS of cfg_file, as an
    ``IMPORTS [...]`` pair put first."""
    opts = list(opts)
    if not modules:
        return opts
    for i in range(0, len(opts) - 1, 2):
        if opts[i] == "IMPORTS":  # an explicit override: --import adds to it
            given = parse_literal(opts[i + 1])
            opts[i + 1] = repr(
                list(dict.fromkeys([*(given if isinstance(given, list) else [given]), *modules]))
            )
            return opts
    cfg = get_defaults()
    if cfg_file:
        merge_file(cfg, cfg_file)
    return ["IMPORTS", repr(list(dict.fromkeys([*cfg.IMPORTS, *modules]))), *opts]
