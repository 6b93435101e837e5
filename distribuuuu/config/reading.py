"""Reading a config: YAML files (their encodings and mistakes), ``KEY VALUE`` overrides, and the
check of every key name and value type against the defaults. Errors are ``UserError`` (exit 2)."""

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
from distribuuuu.config.defaults import EITHER_TYPES, NULLABLE_TYPES, get_defaults
from distribuuuu.errors import UserError


def flatten(node: CN, prefix: str = "") -> dict[str, Any]:
    """{"OPTIM.BASE_LR": 0.1, ...}: every leaf of a config tree under its full dotted name."""
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
    """Return value converted to the type of the key's default, or raise UserError."""
    if key in EITHER_TYPES:
        if isinstance(value, EITHER_TYPES[key]):
            return value
        raise UserError(f"config key {key} expects {' or '.join(_a(_type_name(t)) for t in EITHER_TYPES[key])}, "
                        f"got {value!r} ({_type_name(type(value))}) from {source}")
    expected = NULLABLE_TYPES.get(key, type(default))
    if value is None:
        if key in NULLABLE_TYPES:
            return None
        raise UserError(f"config key {key} cannot be None ({source}); expected {_a(_type_name(expected))}")
    if expected is tuple:
        expected = list
    if isinstance(value, tuple):
        value = list(value)
    ok = isinstance(value, expected)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True  # 1 is a fine float
    if expected is float and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
        value, ok = float(value), True  # YAML 1.1 reads 1e-3 (no dot) as text; people mean the number
    if expected is int and isinstance(value, bool):
        ok = False  # True is not a count
    if expected is str and key in NULLABLE_TYPES and isinstance(value, str) and value.lower() in ("none", "null", ""):
        return None
    if not ok:
        raise UserError(
            f"config key {key} expects {_a(_type_name(expected))}, got {value!r} "
            f"({_type_name(type(value))}) from {source}"
        )
    return value


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def parse_literal(text: str) -> Any:
    """Command-line values are Python literals; anything else is a plain string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _set(cfg: CN, pairs: Iterable[tuple[str, Any]], source: str) -> None:
    known = flatten(get_defaults())
    for key, value in pairs:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else " (run `distribuuuu config` to list the keys)"
            raise UserError(f"unknown config key {key}{hint} in {source}")
        value = _coerce(key, value, known[key], source)
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value


# Byte-order marks and their codecs; the UTF-32 ones first (UTF-32 LE's begins with UTF-16 LE's).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
_MAX_CFG_BYTES = 16 << 20  # far above any config; a bigger --cfg is some other file
# Leading bytes of files that users pass to --cfg by mistake
_MAGIC = ((b"PK\x03\x04", "a zip archive (a PyTorch checkpoint?)"), (b"\x80", "a pickle (a PyTorch checkpoint?)"),
          (b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"\x1f\x8b", "gzip data"),
          (b"\x7fELF", "a program"))


def _looks_like(raw: bytes) -> str:
    """A guess at what a file that is not UTF-8 YAML text is, for the error message."""
    for magic, what in _MAGIC:
        if raw.startswith(magic):
            return what
    head = raw[:4096]
    if len(head) >= 4 and head[1::2].count(0) > len(head) // 4:
        return "UTF-16 text without a byte-order mark"
    return "binary data" if b"\x00" in head else "text in another encoding (e.g. Latin-1)"


def _read_text(path: str) -> str:
    """The text of a config file: UTF-8, or UTF-8/16/32 with a byte-order mark (what Windows
    editors and PowerShell's `>` write). Anything else is a UserError saying what it looks like."""
    with open(path, "rb") as f:
        raw = f.read(_MAX_CFG_BYTES + 1)
    fix = "save it as UTF-8 text, or pass a YAML file such as config/resnet18.yaml"
    if len(raw) > _MAX_CFG_BYTES:
        raise UserError(f"config file {path!r} is larger than {_MAX_CFG_BYTES >> 20} MiB, so it is not a YAML "
                        f"config (it looks like {_looks_like(raw)}); pass a YAML file such as config/resnet18.yaml")
    codec = next((c for bom, c in _BOMS if raw.startswith(bom)), "utf-8")
    try:
        text = raw.decode(codec)
    except UnicodeDecodeError as e:
        raise UserError(f"config file {path!r} is not {codec.upper().replace('-SIG', '')} YAML text (byte "
                        f"0x{raw[e.start]:02x} at offset {e.start}; it looks like {_looks_like(raw)}); {fix}") from None
    if "\x00" in text:  # valid UTF-8, but YAML text never holds NUL: UTF-16 without a BOM, or binary
        raise UserError(f"config file {path!r} is not UTF-8 YAML text (NUL bytes; it looks like "
                        f"{_looks_like(raw)}); {fix}")
    return text


def merge_file(cfg: CN, path: str) -> None:
    """Merge a YAML file into cfg, checking every key and type. path is a file, or the name of a
    shipped config (see shipped.resolve: a file that exists wins)."""
    path = shipped.resolve(path)
    if os.path.isdir(path):
        raise UserError(f"config file {path!r} is a folder; pass --cfg with a YAML file such as config/resnet18.yaml")
    if not os.path.isfile(path):
        raise UserError(shipped.missing_message(path))
    _merge_yaml(cfg, _read_text(path), f"config file {path!r}", f"config file {path}")


def merge_text(cfg: CN, text: str, source: str) -> None:
    """Merge YAML text (e.g. the config stored in a checkpoint) into cfg, checking every key and
    type as for a file; unlike yacs's merge_from_other_cfg, it takes a MODEL.PRETRAINED path."""
    _merge_yaml(cfg, text, source, source)


def _merge_yaml(cfg: CN, text: str, source: str, plain_source: str) -> None:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{source} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{source} must hold a mapping of KEY: value, not {type(data).__name__}")
    _set(cfg, _flatten_plain(data), plain_source)


def merge_opts(cfg: CN, opts: list[str]) -> None:
    """Merge a ``KEY VALUE KEY VALUE ...`` list; values are parsed as Python literals."""
    if len(opts) % 2:
        raise UserError(
            f"overrides come in KEY VALUE pairs, but {len(opts)} words were given: {' '.join(opts)!r}"
        )
    pairs = [(opts[i], parse_literal(opts[i + 1])) for i in range(0, len(opts), 2)]
    _set(cfg, pairs, "the command line")
