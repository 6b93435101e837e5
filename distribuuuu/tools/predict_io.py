"""predict's inputs and outputs: files, folders and globs expanded to
image paths; the top-k classes printed as a table or written as CSV or
JSON.

CSV: a header ``path,class_1,prob_1,...,class_k,prob_k``, then one row
per image. JSON: a list of ``{"path": ..., "classes": [k names, most
likely first], "probs": [k probabilities]}``, one per image.
"""

from __future__ import annotations

import csv
import glob
import json
import os
from collections.abc import Sequence
from typing import TextIO

from distribuuuu.errors import UserError

# torchvision's ImageFolder extensions: what a folder or a glob
# contributes (a file named alone is tried whatever its name)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
FORMATS = ("csv", "json")

Results = Sequence[Sequence[tuple[str, float]]]


def is_image_name(path: str) -> bool:
    return path.lower().endswith(IMAGE_EXTENSIONS)


def _folder_images(folder: str) -> list[str]:
    """The images under folder, recursively (following symlinks, as
    ImageFolder does), sorted; hidden entries skipped."""
    found, seen = [], set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a symlink loop (or a second link to a folder): each folder once
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [
            os.path.join(root, f)
            for f in sorted(files)
            if is_image_name(f) and not f.startswith(".")
        ]
    return found


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Image paths, in the order given: a file as it is, a folder's
    images (recursively), a glob's matches (expanded here, so quoted
    globs work; ** crosses folders). A folder or a glob without images,
    and a path that does not exist, are a UserError naming it."""
    images: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = _folder_images(item)
            if not found:
                raise UserError(
                    f"folder {item!r} holds no images ({', '.join(IMAGE_EXTENSIONS)}, searched "
                    "recursively)"
                )
        elif os.path.exists(item):
            found = [item]
        elif glob.has_magic(item):
            matches = sorted(glob.glob(item, recursive=True))
            found = [
                p
                for m in matches
                for p in (_folder_images(m) if os.path.isdir(m) else [m])
                if is_image_name(p)
            ]
            if not found:
                what = (
                    f"matches {len(matches)} path(s) but no image" if matches else "matches nothing"
                )
                raise UserError(
                    f"the pattern {item!r} {what}; give image files, folders, or a glob such as "
                    "'photos/*.jpg' (in quotes)"
                )
        else:
            raise UserError(f"image file {item!r} does not exist")
        images += found
    return list(dict.fromkeys(images))  # a file named twice (a folder and a glob) is predicted once


def output_format(output: str | None, fmt: str | None) -> str | None:
    """csv / json from --format, else from --output's suffix; None:
    print the table."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise UserError(f"--format must be csv or json, got {fmt!r}")
        return fmt
    if output is None:
        return None
    suffix = os.path.splitext(output)[1].lower().lstrip(".")
    if suffix not in FORMATS:
        raise UserError(
            f"--output {output!r}: cannot tell the format from its suffix; name it .csv or .json, "
            "or add --format csv|json"
        )
    if os.path.isdir(output):
        raise UserError(f"--output {output!r} is a folder; give a file name such as preds.csv")
    return suffix


def print_table(images: Sequence[str], results: Results) -> None:
    """Each path, then its classes ranked with their probabilities."""
    width = max(len(name) for top in results for name, _ in top)
    for path, top in zip(images, results):
        print(path)
        for rank, (name, p) in enumerate(top, 1):
            print(f"  {rank}. {name:<{width}}  {p:.4f}")


def write(f: TextIO, fmt: str, images: Sequence[str], results: Results) -> None:
    """The predictions as CSV or JSON (see the module docstring)."""
    if fmt == "json":
        rows = [
            {"path": path, "classes": [n for n, _ in top], "probs": [p for _, p in top]}
            for path, top in zip(images, results)
        ]
        f.write("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n")  # one image per line
        return
    k = max((len(top) for top in results), default=0)
    writer = csv.writer(f)
    writer.writerow(["path", *[f"{col}_{i}" for i in range(1, k + 1) for col in ("class", "prob")]])
    for path, top in zip(images, results):
        writer.writerow([path, *[v for name, p in top for v in (name, f"{p:.6f}")]])
