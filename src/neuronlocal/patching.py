"""Patches applied to a library module right after it is imported, never before.

Some glue has to change a library function (an upstream gap, documented where the patch is
defined). Importing those libraries at `import torch` time would be slow and could fail, so
`after_import(name, fn)` installs an import hook instead: when module `name` has executed,
`fn(module)` runs once, before any `from name import x` elsewhere sees the module. A module
already imported is patched at once. A patch that fails is logged and the module runs
unpatched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_pending: dict[str, Callable[[ModuleType], None]] = {}
_applied: set[str] = set()


def _apply(name: str, module: ModuleType) -> None:
    with _lock:
        if name in _applied or name not in _pending:
            return
        _applied.add(name)
        patch = _pending[name]
    try:
        patch(module)
    except Exception as exc:  # a library version we do not know: leave it unpatched
        logger.warning("neuronlocal: could not patch %s (%s); it runs unpatched.", name, exc)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then the patch for the module."""

    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _apply(self._name, module)

    def __getattr__(self, attr: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._inner, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the modules waiting for a patch."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _pending or fullname in _applied:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_finder = _Finder()


def after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Runs `patch(module)` once, right after module `name` is imported (or now)."""
    with _lock:
        _pending.setdefault(name, patch)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    if name in sys.modules:
        _apply(name, sys.modules[name])


def applied() -> list[str]:
    """Modules patched so far in this process."""
    return sorted(_applied)
