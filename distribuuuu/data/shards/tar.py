"""Reading the samples of one tar shard in order, by parsing its
512-byte headers directly.

Why not tarfile or webdataset: both build a TarInfo object per member
and re-read the stream through several layers; on small JPEGs that costs
~85 us per sample against ~6 us for the header parse here
(docs/performance.md section 8), enough to make shards slower per core
than the folder. Skipping samples (a resumed epoch, a worker's part of a
shard) seeks past their data instead of reading it. Handled: POSIX ustar
and GNU members, pax ('x') and GNU long-name ('L') headers (what tarfile
and TarWriter write for long names), directories and other non-files
(skipped), the end-of-archive zero block. A shard that ends before that
block (inside a member or between two), or whose header checksum is
wrong, raises ShardError naming the shard and the byte offset.

A sample is the run of consecutive members sharing a key (the name up to
the first '.' of its last path component, webdataset's rule); its fields
are the rest of the name (``jpg``, ``cls``, ...).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import BinaryIO

from distribuuuu.errors import UserError

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif", "img")


class ShardError(UserError):
    """A shard that cannot be read as a tar (truncated, or not a tar):
    names the shard."""


Sample = tuple[str, dict[str, bytes]]  # (key, {field: data})


def _number(field: bytes) -> int:
    """A header's octal number (GNU base-256 for sizes >= 8 GiB)."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    text = field.rstrip(b"\0 ").lstrip(b" ")
    return int(text, 8) if text else 0


def _checksum_ok(header: bytes) -> bool:
    """The stored checksum is the sum of the header's bytes with its own
    8 counted as spaces."""
    field = header[148:156]
    return _number(field) == sum(header) - sum(field) + 8 * 32


def _pax_path(data: bytes) -> str | None:
    """The 'path' record of a pax extended header ('<len>
    path=<name>\\n' records)."""
    for record in data.split(b"\n"):
        _, _, kv = record.partition(b" ")
        if kv.startswith(b"path="):
            return kv[5:].decode("utf-8", "replace")
    return None


def members(
    f: BinaryIO, path: str, want_data: bool | Callable[[str], bool] = True
) -> Iterator[tuple[str, int, bytes | None]]:
    """(name, byte offset of its first header, data or None) of each
    regular file in the shard, in order; want_data: whether to read the
    data, or which members' (by name)."""
    end = os.fstat(f.fileno()).st_size
    long_name, first = None, None
    while True:
        offset = f.tell()
        header = f.read(BLOCK)
        if header == _ZERO_BLOCK:
            return  # the end-of-archive block (tarfile and every tar writer end the file with two)
        if len(header) < BLOCK or not _checksum_ok(header):
            why = (
                "ends before its end-of-archive block"
                if not header
                else "ends inside a header"
                if len(header) < BLOCK
                else "has a header with a wrong checksum"
            )
            raise ShardError(
                f"shard {path} {why} at byte {offset}: truncated or not a tar file; restore it or "
                "re-run `distribuuuu data shard`"
            )
        size, kind = _number(header[124:136]), header[156:157]
        name, first = long_name or _name(header), offset if first is None else first
        if offset + BLOCK + size > end:
            raise ShardError(
                f"shard {path} ends inside member {name!r} (header at byte {offset}, {size} data "
                "bytes): truncated; restore it or re-run `distribuuuu data shard`"
            )
        wanted = want_data(name) if callable(want_data) else want_data
        data = f.read(size) if wanted or kind in (b"x", b"L") else None
        f.seek(offset + BLOCK + (size + BLOCK - 1) // BLOCK * BLOCK)
        if kind == b"x":
            long_name = _pax_path(data)
            continue
        if kind == b"L":
            long_name = data.rstrip(b"\0").decode("utf-8", "replace")
            continue
        if kind in (
            b"0",
            b"\0",
            b"7",
        ):  # regular files; directories, links and pax globals are skipped
            yield name, first, data
        long_name, first = None, None


def _name(header: bytes) -> str:
    name = header[:100].rstrip(b"\0").decode("utf-8", "replace")
    if header[257:262] == b"ustar":  # a ustar prefix holds the leading directories of long paths
        prefix = header[345:500].rstrip(b"\0").decode("utf-8", "replace")
        if prefix:
            name = f"{prefix}/{name}"
    return name


def split_name(name: str) -> tuple[str, str]:
    """'dir/00000012.jpg' -> ('dir/00000012', 'jpg'): webdataset's key
    and field rule."""
    folder, slash, base = name.rpartition("/")
    stem, _, field = base.partition(".")
    return folder + slash + stem, field.lower()


def _sample_offset(f: BinaryIO, path: str, skip: int) -> int:
    """The byte offset where sample number ``skip`` (0-based) starts:
    headers walked, data seeked past."""
    key, seen = None, 0
    for name, offset, _ in members(f, path, want_data=False):
        k = split_name(name)[0]
        if k != key:
            if seen == skip:
                return offset
            seen, key = seen + 1, k
    return f.tell()


def samples(
    path: str, skip: int = 0, want_data: bool | Callable[[str], bool] = True
) -> Iterator[Sample]:
    """The shard's samples in order, from sample number ``skip`` on
    (those before are not read); want_data as for members (a field not
    read is None)."""
    with open(path, "rb") as f:
        if skip:
            f.seek(_sample_offset(f, path, skip))
        key, fields = None, {}
        for name, _, data in members(f, path, want_data):
            k, field = split_name(name)
            if k != key and key is not None:
                yield key, fields
                fields = {}
            key, fields[field] = k, data
        if key is not None:
            yield key, fields
