"""What an image-folder split really holds: each image once, no symlink loop, no unreadable class.

``list_split`` lists <split>/<class>/... as torchvision's ImageFolder does (symlinks followed, the
same files in the same order), in one walk that also notes what ImageFolder does not see:

- a symlink to a folder that contains it (``ln -s .. train/2/loop``): os.walk follows it again and
  again until the path is too long, turning 300 images into tens of thousands. The walk does not
  enter it; ``require_no_loop`` (the preflight and the datasets) refuses the split, naming the
  link and where it points.
- the same real file listed twice (a symlinked file or folder reaching what is listed elsewhere,
  or a hard link: the same st_dev and st_ino): an image trained on twice as often, or under two labels. ``require_no_duplicates`` (the
  preflight, data/check.py, unless TRAIN.DUPLICATE_IMAGES keep: deliberate oversampling by
  symlinks) refuses it with the count and the first pairs. The datasets list every copy, as
  ImageFolder does, so the ranks do not pay for resolving file links again.

Cost: the walk reads each folder once (os.scandir, as os.walk); a real path is computed per
symlink only (a plain entry's is its folder's plus its name; a file link's costs a readlink and
an lstat, see _link_target; hard links are grouped by readdir's inode numbers, and only files sharing
one are stat'ed), so a tree without links costs no more than ImageFolder's listing.
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
    inodes: dict[str, int] = field(default_factory=dict)  # plain file name -> d_ino (free from readdir)


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
        names, links, inodes = [], [], {}
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
                else:
                    inodes[e.name] = e.inode()
        found.append(FolderDir(root, chain[-1], sorted(names), sorted(links), inodes))
    return sorted(found, key=lambda d: d.root)  # os.walk's tuples, sorted as ImageFolder sorts them


def list_split(split_dir: str, classes: list[str]) -> SplitListing:
    """The image files of split_dir/<class> for each class (folders that do not exist: none)."""
    listing = SplitListing(split_dir, list(classes))
    for c in classes:
        class_dir = os.path.join(split_dir, c)
        if os.path.isdir(class_dir):
            listing.dirs[c] = _walk_class(class_dir, listing.loops)
    return listing


def _link_target(path: str, folders: dict[str, str]) -> tuple[str, os.stat_result] | None:
    """The real path of the file a symlink points to and its stat (None if it points to nothing).

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
        st = os.lstat(real)
        if stat.S_ISLNK(st.st_mode):
            real = os.path.realpath(real)
            st = os.stat(real)
    except OSError:
        return None  # a dangling link: an unreadable image, not a duplicate
    return (real, st) if stat.S_ISREG(st.st_mode) else None


def file_id(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file path names, links followed: the same pair is the same file
    (a symlink or a hard link of it); None if it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _hard_links(plain: list[tuple[str, int]]) -> tuple[list[tuple[str, str]], dict[int, list[str]]]:
    """(path listed again, path listed first) for hard links among plain files, and {d_ino: paths}.

    readdir's d_ino groups the candidates at no cost; only files sharing one are stat'ed, since
    d_ino alone can mislead (two devices, overlayfs). A tree without hard links costs nothing more.
    """
    by_ino: dict[int, list[str]] = {}
    for path, ino in plain:
        by_ino.setdefault(ino, []).append(path)
    pairs: list[tuple[str, str]] = []
    for paths in by_ino.values():
        if len(paths) < 2:
            continue
        first: dict[tuple[int, int], str] = {}
        for path in paths:
            key = file_id(path)
            if key in first:
                pairs.append((path, first[key]))
            elif key is not None:
                first[key] = path
    return pairs, by_ino


def duplicates(listing: SplitListing) -> list[tuple[str, str]]:
    """(path listed again, path listed first) for every file whose real file was already listed.

    A folder whose real path was listed before repeats all its plain files; a plain file may be a
    hard link of another (the same st_dev and st_ino); a symlinked file repeats a plain file of a
    listed folder (found from its real path, or its inode), or another link's target.
    """
    first_dir: dict[str, str] = {}  # real folder -> the path it was first listed under
    pairs: list[tuple[str, str]] = []
    linked: list[str] = []
    plain: list[tuple[str, int]] = []  # (path, d_ino) of the plain files of first-listed folders
    for c in listing.classes:
        for d in listing.dirs.get(c, []):
            links = set(d.links)
            linked += [os.path.join(d.root, n) for n in d.names if n in links]
            if d.real in first_dir:
                pairs += [(os.path.join(d.root, n), os.path.join(first_dir[d.real], n))
                          for n in d.names if n not in links]
            else:
                first_dir[d.real] = d.root
                plain += [(os.path.join(d.root, n), d.inodes[n]) for n in d.names if n in d.inodes]
    hard, by_ino = _hard_links(plain)
    pairs += hard
    first_link: dict[tuple[int, int], str] = {}
    folders: dict[str, str] = {}
    for path in linked:
        target = _link_target(path, folders)
        if target is None:
            continue
        (folder, name), key = os.path.split(target[0]), (target[1].st_dev, target[1].st_ino)
        if folder in first_dir and has_file_allowed_extension(name, IMG_EXTENSIONS):
            pairs.append((path, os.path.join(first_dir[folder], name)))
            continue
        same = [p for p in by_ino.get(key[1], []) if file_id(p) == key]  # a hard link of a listed file
        if same:
            pairs.append((path, same[0]))
        elif key in first_link:
            pairs.append((path, first_link[key]))
        else:
            first_link[key] = path
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
    """UserError counting the files listed twice (through symlinks or hard links), naming the first few pairs."""
    pairs = duplicates(listing)
    if pairs:
        split = listing.split_dir.rstrip(os.sep) + os.sep
        rel = (lambda p: p[len(split):] if p.startswith(split) else p)  # noqa: E731 (names within the split)
        shown = "; ".join(f"{rel(again)} is {rel(first)}" for again, first in pairs[:NAMED])
        more = f" (and {len(pairs) - NAMED} more)" if len(pairs) > NAMED else ""
        raise UserError(f"{key}.DATASET: {len(pairs)} image file(s) in {listing.split_dir} are, through symlinks or hard "
                        "links, "
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
