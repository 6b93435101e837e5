"""A split of encoded images with their labels: what every reader of
image files gives the loaders, the checks and the recipe.

An image folder is one such reader (folder.py); each further format
(a label file, a Hugging Face dataset) is another, and everything
downstream (decoding, the held-out part, the data checks, the recipe
from the images) reads them through this one interface.
"""

from __future__ import annotations

import pathlib

from distribuuuu.errors import UserError


class ImageFiles:
    """The items of one split: item i is the encoded image ``read(i)``
    with label ``targets[i]``; ``name(i)`` says where it is in messages.
    ``paths`` are the files on disk when there are files (their identity
    finds a file listed twice); a reader of bytes leaves it None."""

    def __init__(self, root: str, classes: list[str], paths: list[str], targets: list[int]) -> None:
        self.root, self.classes = root, classes
        self.paths: list[str] | None = paths
        self.targets = targets

    def __len__(self) -> int:
        return len(self.targets)

    def read(self, i: int) -> bytes:
        return pathlib.Path(self.paths[i]).read_bytes()

    def size(self, i: int) -> int:
        """Item i's byte size (a reader of bytes may know it unread)."""
        return len(self.read(i))

    def name(self, i: int) -> str:
        return self.paths[i]


def class_indices(where: str, labels: list, classes: list[str]) -> list[int]:
    """Each label's index in ``classes``: whole numbers are indices
    already, names are looked up; a UserError names a label that is not
    a class (a TEST split's labels must be training classes)."""
    if all(isinstance(v, int) for v in labels):
        bad = next((v for v in labels if v >= len(classes)), None)
        if bad is not None:
            raise UserError(f"{where}: label {bad} is not one of the {len(classes)} classes")
        return labels
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted(set(labels) - set(index))
    if unknown:
        raise UserError(
            f"{where} has labels that are not classes of the training data: "
            f"{', '.join(unknown[:5])}; evaluate on data of the training classes"
        )
    return [index[v] for v in labels]
