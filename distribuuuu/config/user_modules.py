"""IMPORTS: the user's own modules, imported before the model and the
data are built.

A module named in IMPORTS (or given with ``--import``) registers what
the run then finds by name, e.g. a timm model decorated with
``@timm.models.register_model`` that MODEL.ARCH names. Every process
imports them itself: ``load_config`` does it, and each rank (torchrun,
srun, the spawner's children) loads its config. A module that cannot be
imported is a UserError (exit status 2).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator
from types import ModuleType

from distribuuuu.errors import UserError

_imported: dict[str, ModuleType] = {}  # IMPORTS entry -> module: each is executed once per process


def is_path(entry: str) -> bool:
    """A .py file path rather than a dotted module name."""
    return entry.endswith(".py") or os.sep in entry


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    """The current folder is searched last, as `python -m` would search
    it (the installed `distribuuuu` command starts with its own bin/
    folder instead), then taken off again."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _import_file(path: str) -> ModuleType:
    """Execute a .py file as the module named by its file name
    (registered in sys.modules, so that pickling what it defines works
    in this process)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise FileNotFoundError(f"no such file: {full}")
    name = os.path.splitext(os.path.basename(full))[0]
    known = sys.modules.get(name)
    if known is not None and os.path.abspath(getattr(known, "__file__", "") or "") == full:
        return known
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise ImportError(f"{full} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_user_modules(entries: Iterable[str]) -> list[ModuleType]:
    """Import each IMPORTS entry (a dotted module name or a .py path)
    once per process; UserError naming the entry and the error when one
    cannot be imported."""
    return [_imported[entry] if entry in _imported else _import(entry) for entry in entries]


def _import(entry: str) -> ModuleType:
    try:
        if is_path(entry):
            module = _import_file(entry)
        else:
            with _cwd_on_path():
                module = importlib.import_module(entry)
    except Exception as e:  # noqa: BLE001 - any failure of the user's code is reported the same way
        raise UserError(
            f"IMPORTS: cannot import {entry!r} ({type(e).__name__}: {e}); check the name, that its "
            "folder is on PYTHONPATH (or give the path of a .py file), and that the module itself "
            "imports"
        ) from None
    _imported[entry] = module
    return module
