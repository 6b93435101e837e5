"""What an image-folder split really holds: each image once, no symlink loop, no unreadable class.

``list_split`` lists <split>/<class>/... as torchvision's ImageFolder does (symlinks followed, the
same files in the same order), in one walk that also notes what ImageFolder does not see:

- a symlink to a folder that contains it (``ln -s .. train/2/loop``): os.walk follows it again and
  again until the path is too long, turning 300 images into tens of thousands. The walk does not
  enter it; ``require_no_loop`` (the preflight and the datasets) refuses the split, naming the
  link and where it points.
- the same real file listed twice (a symlinked file or folder reaching what is listed elsewhere):
  an image trained on twice as often, or under two labels. ``require_no_duplicates`` (the
  preflight, data/check.py, unless TRAIN.DUPLICATE_IMAGES keep: deliberate oversampling by
  symlinks) refuses it with the count and the first pairs. The datasets list every copy, as
  ImageFolder does, so the ranks do not pay for resolving file links again.

Cost: the walk reads each folder once (os.scandir, as os.walk); a real path is computed per
symlink only (a plain entry's is its folder's plus its name; a file link's costs a readlink and
an lstat, see _link_target), so a tree without links costs no more than ImageFolder's listing.
``first_readable`` opens the files of one class until one decodes.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from distribuuuu.errors import UserError

NAMED = 5  # how many offenders a message names

# What the datasets treat as an unreadable file (sources.ImageFolderWithClasses catches the same).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


@dataclass
class FolderDir:
    """One folder the walk listed: its path as listed, its real path, and its image file names
    (sorted; ``links`` are those of them that are symlinks)."""

    root: str
    real: str
    names: list[str]
    links: list[str]


@dataclass
class SplitListing:
    """The image files of a split, per class in ImageFolder's order, and the symlink loops met."""

    split_dir: str
    classes: list[str]
    dirs: dict[str, list[FolderDir]] = field(default_factory=dict)  # class -> its folders, sorted
    loops: list[tuple[str, str]] = field(default_factory=list)  # (symlink, the real folder it points to)

    def files(self, cls: str) -> list[str]:
        """The image paths of one class, in ImageFolder's order."""
        return [os.path.join(d.root, n) for d in self.dirs.get(cls, []) for n in d.names]

    def count(self, cls: str) -> int:
        return sum(len(d.names) for d in self.dirs.get(cls, []))

    def samples(self) -> list[tuple[str, int]]:
        """(path, class index) of every listed file, as DatasetFolder.make_dataset returns them
        (classes in name order, each labelled with its index in self.classes)."""
        index = {c: i for i, c in enumerate(self.classes)}
        return [(path, index[c]) for c in sorted(self.classes) for path in self.files(c)]


def _is_inside(real: str, folder: str) -> bool:
    """Whether the real path `real` is `folder` or lies below it."""
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


def _walk_class(class_dir: str, loops: list[tuple[str, str]]) -> list[FolderDir]:
    """The folders below class_dir (itself included), symlinks followed except into a loop.

    A symlinked folder is a loop when it points to a folder that contains one on the way down
    (real paths compared): entering it would lead back to the same link. Unreadable folders are
    skipped, as os.walk skips them.
    """
    found: list[FolderDir] = []
    stack = [(class_dir, (os.path.realpath(class_dir),))]  # (listed path, real paths from the class down)
    while stack:
        root, chain = stack.pop()
        try:
            with os.scandir(root) as it:
                entries = list(it)
        except OSError:
            continue
        names, links = [], []
        for e in entries:
            try:
                is_dir = e.is_dir()  # follows symlinks, as os.walk(followlinks=True)
            except OSError:
                is_dir = False
            if is_dir:
                if e.is_symlink():
                    target = os.path.realpath(e.path)
                    if any(_is_inside(r, target) for r in chain):
                        loops.append((e.path, target))
                        continue
                else:
                    target = os.path.join(chain[-1], e.name)
                stack.append((e.path, chain + (target,)))
            elif has_file_allowed_extension(e.name, IMG_EXTENSIONS):
                names.append(e.name)
                if e.is_symlink():
                    links.append(e.name)
        found.append(FolderDir(root, chain[-1], sorted(names), sorted(links)))
    return sorted(found, key=lambda d: d.root)  # os.walk's tuples, sorted as ImageFolder sorts them


def list_split(split_dir: str, classes: list[str]) -> SplitListing:
    """The image files of split_dir/<class> for each class (folders that do not exist: none)."""
    listing = SplitListing(split_dir, list(classes))
    for c in classes:
        class_dir = os.path.join(split_dir, c)
        if os.path.isdir(class_dir):
            listing.dirs[c] = _walk_class(class_dir, listing.loops)
    return listing


def _link_target(path: str, folders: dict[str, str]) -> str | None:
    """The real path of the file a symlink points to (None if it points to nothing).

    os.path.realpath costs one lstat per path component; ImageNet subsets made of links into one
    pool would pay that 10+ times per file. Here: readlink, the real path of the target's folder
    (cached: the targets of a class usually share one), and one lstat; realpath only for a link
    to a link.
    """
    folder, name = os.path.split(os.path.join(os.path.dirname(path), os.readlink(path)))
    if folder not in folders:
        folders[folder] = os.path.realpath(folder)
    real = os.path.join(folders[folder], name)
    try:
        mode = os.lstat(real).st_mode
    except OSError:
        return None  # a dangling link: an unreadable image, not a duplicate
    if stat.S_ISLNK(mode):
        real = os.path.realpath(real)
        return real if os.path.isfile(real) else None
    return real if stat.S_ISREG(mode) else None


def duplicates(listing: SplitListing) -> list[tuple[str, str]]:
    """(path listed again, path listed first) for every file whose real file was already listed.

    A folder whose real path was listed before repeats all its plain files; a symlinked file
    repeats a plain file of a listed folder (found from its real path), or another link's target.
    """
    first_dir: dict[str, str] = {}  # real folder -> the path it was first listed under
    pairs: list[tuple[str, str]] = []
    linked: list[str] = []
    for c in listing.classes:
        for d in listing.dirs.get(c, []):
            links = set(d.links)
            linked += [os.path.join(d.root, n) for n in d.names if n in links]
            if d.real in first_dir:
                pairs += [(os.path.join(d.root, n), os.path.join(first_dir[d.real], n))
                          for n in d.names if n not in links]
            else:
                first_dir[d.real] = d.root
    first_link: dict[str, str] = {}
    folders: dict[str, str] = {}
    for path in linked:
        real = _link_target(path, folders)
        if real is None:
            continue
        folder, name = os.path.split(real)
        if folder in first_dir and has_file_allowed_extension(name, IMG_EXTENSIONS):
            pairs.append((path, os.path.join(first_dir[folder], name)))
        elif real in first_link:
            pairs.append((path, first_link[real]))
        else:
            first_link[real] = path
    return pairs


def require_no_loop(listing: SplitListing, key: str) -> None:
    """UserError naming the symlinks that point to a folder containing them."""
    if listing.loops:
        shown = "; ".join(f"{link} -> {target}" for link, target in listing.loops[:NAMED])
        more = f" (and {len(listing.loops) - NAMED} more)" if len(listing.loops) > NAMED else ""
        raise UserError(f"{key}.DATASET: {len(listing.loops)} symlink(s) in {listing.split_dir} point to a folder "
                        f"that contains them, a loop that would list the same images over and over: {shown}{more}. "
                        f"Remove them (rm {listing.loops[0][0]}) or point them outside the class folders")


def require_no_duplicates(listing: SplitListing, key: str) -> None:
    """UserError counting the files listed twice (through symlinks), naming the first few pairs."""
    pairs = duplicates(listing)
    if pairs:
        split = listing.split_dir.rstrip(os.sep) + os.sep
        rel = (lambda p: p[len(split):] if p.startswith(split) else p)  # noqa: E731 (names within the split)
        shown = "; ".join(f"{rel(again)} is {rel(first)}" for again, first in pairs[:NAMED])
        more = f" (and {len(pairs) - NAMED} more)" if len(pairs) > NAMED else ""
        raise UserError(f"{key}.DATASET: {len(pairs)} image file(s) in {listing.split_dir} are, through symlinks, "
                        f"the same real file as another listed one: {shown}{more}. Remove the extra links, or set "
                        "TRAIN.DUPLICATE_IMAGES keep to train on every listed copy (oversampling)")


def can_decode(path: str) -> str | None:
    """None when path decodes as an image, else why not. JPEGs are decoded at 1/8 scale (PIL
    draft): the whole file is still read, at a fraction of the cost."""
    try:
        with Image.open(path) as image:
            image.draft(image.mode, (1, 1))  # JPEG only; a no-op for other formats
            image.load()
        return None
    except DECODE_ERRORS as e:
        return f"{type(e).__name__}: {e}"


def first_readable(paths: list[str]) -> tuple[str | None, str]:
    """(the first path that decodes, or None; why the first one that did not failed)."""
    why = ""
    for path in paths:
        err = can_decode(path)
        if err is None:
            return path, why
        why = why or f"{path}: {err}"
    return None, why
