"""Compiled graphs as bytes: TorchNeuron's NEFF byte cache and its MegaCache artifact.

On TorchNeuron each compiled graph is a NEFF: its in-memory compilation cache maps the
graph's cache key to `(persistent key, NEFF bytes)` (`get_neff_info`), the persistent key is
a 128-bit hash of the cache key and the graph's IR, and the persistent cache keeps the bytes
at `<cache dir>/<k[0:2]>/<k[2:4]>/<k>.neff` (`put_neff_cache`, `get_neff_cache`).
`torch.compiler.save_cache_artifacts()` collects them as `neuron_neff` artifacts, and
`load_cache_artifacts()` writes them back, so a fresh machine skips the compiler.

No NEFF exists here. What neuronlocal compiles for a graph is the graph itself (the eager
compiler runs it op by op; Inductor's own artifacts travel as Inductor's MegaCache
artifacts), so a graph's bytes are a JSON document naming its cache key, compiler and
versions, with the graph's text (`fingerprint.graph_text`). The persistent key is the
first 128 bits of BLAKE2b over the cache key and that text (TorchNeuron uses XXH3-128 over
the cache key and the HLO; neither key is meant to match across the two). A graph of the
eager compiler whose bytes are in the persistent cache is a cache hit, as a NEFF there is.

The bytes live in the compile cache's folder (`cache.cache_dir()`), under its rules: the
folder and each shard folder must be owned by the user and writable by no one else; files
are written atomically (0600) and opened without following links; a key is 4 to 128 of
`[A-Za-z0-9_-]`, so no name leaves its shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from neuronlocal import patching
from neuronlocal.compile.cache import (
    ArtifactType,
    cache_dir,
    clear_compiled_cache_keys,
    disabled,
    get_compiled_cache_keys,
)
from neuronlocal.core.files import private_dir, read_bounded, write_private

log = logging.getLogger("neuronlocal.compile")
SUFFIX = ".neff"
ARTIFACT_TYPE = "neuron_neff"
FORMAT = "neuronlocal-graph/1"
MAX_NEFF_BYTES = 2**30  # one graph's bytes read back from the cache
_KEY = re.compile(r"^[A-Za-z0-9_-]{4,128}$")


def check_key(key: object) -> str:
    """`key` when it can name a cache file, else ValueError saying what a key may be."""
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"invalid NEFF cache key {key!r}: a key is 4 to 128 characters of "
                         "letters, digits, '_' and '-' (a persistent key is 32 hex digits)")
    return key


def persistent_key(cache_key: str, ir: str) -> str:
    """The 128-bit hex hash of a graph's cache key and its IR (see the module docstring)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(cache_key.encode())
    h.update(ir.encode())
    return h.hexdigest()


def _shard(root: Path, key: str, create: bool, level: int) -> Path | None:
    """`root/k[0:2]/k[2:4]`, each level checked as a private folder; None when unusable."""
    where = root
    for part in (key[:2], key[2:4]):
        where = where / part
        if not create and not os.path.lexists(where):
            return None
        problem = private_dir(where, "NEFF cache folder", create=create)
        if problem:
            log.log(level, "%s; not using it", problem)
            return None
    return where


def _root(create: bool, level: int) -> Path | None:
    if disabled():
        return None
    root = cache_dir()
    if not create and not os.path.lexists(root):
        return None
    problem = private_dir(root, "TORCH_NEURONX_NEFF_CACHE_DIR", create=create)
    if problem:
        log.log(level, "%s; set TORCH_NEURONX_NEFF_CACHE_DIR to a folder only you can write",
                problem)
        return None
    return root


def _place(key: str, create: bool, quiet: bool) -> tuple[Path | None, int]:
    """The shard folder of `key` (None when the cache cannot be used) and the log level of
    failures: debug when `quiet`."""
    level = logging.DEBUG if quiet else logging.WARNING
    root = _root(create=create, level=level)
    return (None if root is None else _shard(root, key, create=create, level=level)), level


def put(key: str, data: bytes, quiet: bool = False) -> bool:
    """Writes `data` as the persistent bytes of `key`; False (logged, at debug level when
    `quiet`) when the cache is disabled or cannot be used or written, as TorchNeuron's put
    reports failure."""
    check_key(key)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"NEFF bytes must be bytes, not {type(data).__name__}")
    shard, level = _place(key, create=True, quiet=quiet)
    if shard is None:
        return False
    try:
        write_private(shard / f"{key}{SUFFIX}", bytes(data))
    except OSError as err:
        log.log(level, "could not write NEFF cache file for %s: %s", key, err.strerror or err)
        return False
    return True


def get(key: str, quiet: bool = False) -> bytes | None:
    """The persistent bytes of `key`; None when missing, empty, a link or unreadable (logged,
    at debug level when `quiet`)."""
    check_key(key)
    shard, level = _place(key, create=False, quiet=quiet)
    if shard is None:
        return None
    try:
        data = read_bounded(shard / f"{key}{SUFFIX}", MAX_NEFF_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.log(level, "NEFF cache file for %s not read: %s", key, err)
        return None
    return data or None


def _clear_persistent() -> None:
    """Removes every `<k>.neff` byte file of the shard folders (not the graph entries or
    Inductor's artifacts at the top), and shard folders left empty."""
    root = _root(create=False, level=logging.WARNING)
    if root is None:
        return
    for first in list(root.iterdir()):
        if len(first.name) != 2 or first.is_symlink() or not first.is_dir():
            continue
        for second in list(first.iterdir()):
            if len(second.name) != 2 or second.is_symlink() or not second.is_dir():
                continue
            for f in second.iterdir():
                if f.name.endswith(SUFFIX) and not f.is_symlink() and f.is_file():
                    with contextlib.suppress(OSError):
                        f.unlink()
            with contextlib.suppress(OSError):
                second.rmdir()
        with contextlib.suppress(OSError):
            first.rmdir()


@dataclass
class _Entry:
    persistent_key: str
    data: bytes


class CompilationCache:
    """This process's compiled graphs, by cache key (TorchNeuron's in-memory compilation
    cache), with its statistics (counted while metrics are enabled, as there)."""

    COUNTERS = ("persistent_hits", "persistent_misses", "total_compilations")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._counts = dict.fromkeys(self.COUNTERS, 0)
        self._seconds = 0.0
        self.metrics_enabled = False

    def compiled(self, cache_key: str, graph_name: str, compiler: str, ir: str,
                 seconds: float) -> bool:
        """Records a graph compiled (or taken from a cache) with its bytes, and writes them
        to the persistent cache unless there already; returns whether they were there."""
        import torch

        from neuronlocal.core import VERSION

        pkey = persistent_key(cache_key, ir)
        doc = {"format": FORMAT, "cache_key": cache_key, "graph_name": graph_name,
               "compiler": compiler, "torch": torch.__version__, "neuronlocal": VERSION,
               "graph": ir}
        data = json.dumps(doc, sort_keys=True).encode()
        found = get(pkey, quiet=True) is not None
        if not found:
            put(pkey, data, quiet=True)  # a read-only or disabled cache: in memory only
        with self._lock:
            self._entries[cache_key] = _Entry(pkey, data)
            if self.metrics_enabled:
                self._counts["persistent_hits" if found else "persistent_misses"] += 1
                if not found:
                    self._counts["total_compilations"] += 1
                    self._seconds += seconds
        return found

    def info(self, cache_key: str) -> tuple[str, bytes] | None:
        with self._lock:
            entry = self._entries.get(cache_key)
        return None if entry is None else (entry.persistent_key, entry.data)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._counts)
            entries = len(self._entries)
            used = sum(len(e.data) for e in self._entries.values())
            seconds = self._seconds
        hits, misses = counts["persistent_hits"], counts["persistent_misses"]
        return {"total_entries": entries, "persistent_hits": hits, "persistent_misses": misses,
                "cache_hits": hits, "cache_misses": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "memory_usage_bytes": used, "total_compilations": counts["total_compilations"],
                "total_compilation_time_ms": seconds * 1e3}

    def clear(self, persistent: bool = True) -> None:
        """Forgets every graph and its counts; `persistent`: also removes the byte files."""
        with self._lock:
            self._entries.clear()
            self._counts = dict.fromkeys(self.COUNTERS, 0)
            self._seconds = 0.0
        if persistent:
            _clear_persistent()


COMPILATION_CACHE = CompilationCache()


def _register_artifact(mod: ModuleType) -> None:
    """Registers the `neuron_neff` artifact type with torch's MegaCache and has its
    `serialize` collect the graphs compiled since the last save first, as TorchNeuron's
    does (so a process that loads artifacts knows the type before reading them)."""
    class NeuronNeffCacheArtifact(mod.CacheArtifact):  # type: ignore[name-defined]
        """A compiled graph's bytes, under its persistent key."""

        @staticmethod
        def type() -> str:
            return ARTIFACT_TYPE

        def populate_cache(self) -> None:
            """Writes the bytes to the persistent cache (load_cache_artifacts); a failure
            is a warning, as torch's other artifacts report theirs."""
            if not put(self.key, self.content):
                log.warning("could not write NEFF bytes %s to the persistent cache", self.key)

    mod.CacheArtifactFactory.register(NeuronNeffCacheArtifact)
    manager = mod.CacheArtifactManager
    stock = manager.serialize.__func__

    def serialize(cls: Any) -> Any:
        for cache_key in get_compiled_cache_keys(ArtifactType.NEURON_NEFF):
            found = COMPILATION_CACHE.info(cache_key)
            if found is not None:
                cls.record_artifact(ARTIFACT_TYPE, *found)
        clear_compiled_cache_keys(ArtifactType.NEURON_NEFF)
        return stock(cls)

    manager.serialize = classmethod(serialize)
    _registered[ARTIFACT_TYPE] = NeuronNeffCacheArtifact


_registered: dict[str, type] = {}


def artifact_class() -> type:
    """The registered `neuron_neff` artifact class (importing torch's MegaCache runs the
    registration)."""
    import torch.compiler._cache  # noqa: F401

    if ARTIFACT_TYPE not in _registered:
        raise RuntimeError("the neuron_neff MegaCache artifact is not registered: this "
                           "PyTorch's torch.compiler._cache could not be patched (see the "
                           "warning logged at import)")
    return _registered[ARTIFACT_TYPE]


def register() -> None:
    patching.after_import("torch.compiler._cache", _register_artifact)


__all__ = ["COMPILATION_CACHE", "artifact_class", "check_key", "get", "persistent_key", "put",
           "register"]
