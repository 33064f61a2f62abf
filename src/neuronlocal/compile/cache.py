"""The two-tier compile cache: in memory, then on disk ("NEFF cache", spec 3.3).

Tier 1 is a dict in this process. Tier 2 is a directory (`TORCH_NEURONX_NEFF_CACHE_DIR`,
default /tmp/neff_cache): Inductor's FX-graph and AOTAutograd caches are pointed inside
it, so the compiled artifacts themselves live there, and for each graph we write an
entry `<key>.neff` (JSON) that names the artifact files the compile produced, with their
SHA-256. On a lookup the entry and its files are verified; a corrupt or truncated entry
is removed (with its files) and the graph recompiles with a warning, never a crash.

Writes are atomic (temp file + rename). Compiles of the same key from concurrent
processes are serialised by a lock file in `TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR` with a
timeout (`TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT`, seconds). `TORCH_NEURONX_DISABLE_NEFF_CACHE=1`
turns both tiers off. Entries travel with torch.compiler.save_cache_artifacts() through
Inductor's own artifacts, which are what a warm process loads.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENTRY_SUFFIX = ".neff"
FORMAT = 1


def cache_dir() -> Path:
    return Path(os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR", "/tmp/neff_cache"))


def lock_dir() -> Path:
    return Path(os.environ.get("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "/tmp/local_cache"))


def disabled() -> bool:
    return os.environ.get("TORCH_NEURONX_DISABLE_NEFF_CACHE", "0").strip().lower() in {
        "1", "true", "yes", "on"} or os.environ.get(
        "TORCH_NEURONX_NEFF_DISABLE_CACHE", "0").strip() == "1"


def lock_timeout() -> float:
    raw = os.environ.get("TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "600")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT={raw!r} is not a number of "
                         "seconds.") from None


class CacheLockTimeout(TimeoutError):
    """Another process held the compile lock of this graph for longer than the timeout."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@dataclass
class Entry:
    key: str
    graph_name: str
    files: dict[str, str]  # artifact path relative to cache_dir() -> sha256
    created: float


class NeffCache:
    """One per process; see the module docstring."""

    def __init__(self) -> None:
        self.memory: dict[str, Any] = {}

    @property
    def inductor_dir(self) -> Path:
        return cache_dir() / "inductor"

    def entry_path(self, key: str) -> Path:
        return cache_dir() / f"{key}{ENTRY_SUFFIX}"

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        if disabled():
            yield
            return
        lock_dir().mkdir(parents=True, exist_ok=True)
        path = lock_dir() / f"{key}.lock"
        deadline = time.monotonic() + lock_timeout()
        with path.open("a+") as f:
            while True:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise CacheLockTimeout(
                            f"waited {lock_timeout():.0f}s for the compile lock {path} held by "
                            "another process; raise TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT or "
                            "remove a stale lock.") from None
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def lookup(self, key: str) -> Entry | None:
        """The verified disk entry for `key`, or None (a corrupt one is removed)."""
        if disabled():
            return None
        path = self.entry_path(key)
        if not path.exists():
            return None
        try:
            raw = json.loads(path.read_bytes())
            if raw.get("format") != FORMAT or raw.get("key") != key:
                raise ValueError("wrong format or key")
            entry = Entry(key, raw["graph_name"], dict(raw["files"]), float(raw["created"]))
            for rel, digest in entry.files.items():
                f = cache_dir() / rel
                if not f.is_file() or _sha256(f) != digest:
                    raise ValueError(f"artifact {rel} is missing or its checksum differs")
        except (OSError, ValueError, KeyError, TypeError) as err:
            warnings.warn(f"neuron compile cache entry {path} is corrupt ({err}); removing it "
                          "and recompiling.", stacklevel=2)
            self.remove(key)
            return None
        return entry

    def remove(self, key: str) -> None:
        path = self.entry_path(key)
        with contextlib.suppress(OSError, ValueError):
            raw = json.loads(path.read_bytes())
            for rel in raw.get("files", {}):
                with contextlib.suppress(OSError):
                    (cache_dir() / rel).unlink()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def snapshot(self) -> set[Path]:
        """Artifact files now in the Inductor cache (to see what a compile adds)."""
        root = self.inductor_dir
        if not root.exists():
            return set()
        return {p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock")}

    def store(self, key: str, graph_name: str, before: set[Path]) -> None:
        if disabled():
            return
        new = sorted(self.snapshot() - before)
        files = {str(p.relative_to(cache_dir())): _sha256(p) for p in new}
        entry = {"format": FORMAT, "key": key, "graph_name": graph_name, "files": files,
                 "created": time.time()}
        atomic_write(self.entry_path(key), json.dumps(entry, indent=1).encode())


def graph_key(code: str, inputs_meta: list[Any], extra: dict[str, Any]) -> str:
    """Hash of the graph code, the input metadata and the versions that affect codegen."""
    import torch

    import neuronlocal

    h = hashlib.sha256()
    for part in (code, repr(inputs_meta), repr(sorted(extra.items())), torch.__version__,
                 neuronlocal.__version__, str(FORMAT)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]
