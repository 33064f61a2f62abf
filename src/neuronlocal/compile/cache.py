"""The persistent compile cache ("NEFF cache"): Inductor's own caches, guarded and verified.

TorchNeuron keeps compiled graphs in `TORCH_NEURONX_NEFF_CACHE_DIR` and serialises concurrent
compiles of one graph with lock files in `TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR`. Here the
compiled artifacts are stock Inductor's (its FX-graph and AOTAutograd caches, pointed inside
the cache directory), so a warm process skips tracing, codegen and the C++ build exactly as
stock Inductor does. Next to them, each graph gets an entry `<key>.neff` (JSON) naming the
artifact files its compile produced, with their SHA-256; a lookup verifies them, and a
corrupt entry is removed with its files and the graph recompiles with a warning.

Inductor's cache holds Python and shared objects that run in this process, so the
directories must be private: the defaults are per user (`neff_cache_<user>` and
`local_cache_<user>` in the temp directory), created 0700, and any directory the current
user does not own, or that others can write, is refused with a one-line warning; the
graph then compiles without the persistent cache. Lock files are opened without following
links. Entry file names are checked to stay inside the cache directory before anything
is read or removed. A read-only cache still serves hits; a miss then compiles privately.
`TORCH_NEURONX_DISABLE_NEFF_CACHE=1` writes nothing to the cache directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from neuronlocal.compile.lowering import LOWERING_FIXES
from neuronlocal.core.config import env_flag, env_seconds, env_str
from neuronlocal.core.files import private_dir, read_json, write_private
from neuronlocal.core.process import killed_with_parent

ENTRY_SUFFIX = ".neff"
FORMAT = 2
# Inductor's own caches, in a folder named by neuron's lowering fixes, so graphs compiled
# before a fix are never served.
INDUCTOR_DIR = f"inductor-{LOWERING_FIXES}"
_KEY = re.compile(r"^[0-9a-f]{16,64}$")
# `device(type='neuron', index=3)` and `'neuron:3'` in graph code, with the core index.
_CORE_INDEX = re.compile(r"(device\(type='neuron'), index=\d+(?=\))|(?<=neuron):\d+")
MAX_ENTRY_BYTES = 2**20  # an entry names a graph's artifact files and their digests
# Write errors that mean the cache cannot take more: compile without it.
_CANNOT_WRITE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES,
                 errno.EPERM}


def _user() -> str:
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = f"uid{os.getuid()}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def cache_dir() -> Path:
    raw = env_str("TORCH_NEURONX_NEFF_CACHE_DIR")
    return Path(raw) if raw else Path(tempfile.gettempdir()) / f"neff_cache_{_user()}"


def lock_dir() -> Path:
    raw = env_str("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR")
    return Path(raw) if raw else Path(tempfile.gettempdir()) / f"local_cache_{_user()}"


def disabled() -> bool:
    return env_flag("TORCH_NEURONX_DISABLE_NEFF_CACHE") or env_flag(
        "TORCH_NEURONX_NEFF_DISABLE_CACHE")


def lock_timeout() -> float:
    return env_seconds("TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT")


class CacheLockTimeout(TimeoutError):
    """Another process held the compile lock of this graph for longer than the timeout."""


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def inside(root: Path, rel: str) -> Path | None:
    """`root / rel` when `rel` names a file strictly inside `root`, else None."""
    if not rel or os.path.isabs(rel) or "\0" in rel:
        return None
    parts = Path(rel).parts
    if any(p in ("..", ".", "") for p in parts):
        return None
    full = root / rel
    try:
        real_root = root.resolve(strict=True)
        if os.path.commonpath([real_root, full.resolve()]) != str(real_root):
            return None
    except (OSError, ValueError):
        return None
    return full


@dataclass
class Entry:
    key: str
    graph_name: str
    files: dict[str, str]  # artifact path relative to the Inductor directory -> sha256
    created: float


@dataclass(frozen=True)
class State:
    """How the persistent cache can be used by this process right now."""

    mode: str  # "rw", "ro" (hits only) or "off"
    root: Path | None = None

    @property
    def inductor_dir(self) -> Path | None:
        return None if self.root is None else self.root / INDUCTOR_DIR


class NeffCache:
    """One per process; see the module docstring."""

    def __init__(self) -> None:
        self.memory: dict[str, Any] = {}
        self._private_tmp: Path | None = None
        self._unwritable: Path | None = None  # a cache a write failed in: not used again

    # ---- where things go -------------------------------------------------------------
    def state(self) -> State:
        if disabled():
            return State("off")
        if self._unwritable is not None and self._unwritable == cache_dir():
            return State("off")
        root = cache_dir()
        problem = private_dir(root, "TORCH_NEURONX_NEFF_CACHE_DIR")
        if problem:
            _warn_once(f"neuron compile cache disabled: {problem}. Set "
                       "TORCH_NEURONX_NEFF_CACHE_DIR to a directory only you can write.")
            return State("off")
        inductor = root / INDUCTOR_DIR
        with contextlib.suppress(OSError):
            inductor.mkdir(mode=0o700, exist_ok=True)
        if os.access(root, os.W_OK) and (not inductor.exists() or os.access(inductor, os.W_OK)):
            return State("rw", root)
        if inductor.is_dir():
            return State("ro", root)
        _warn_once(f"neuron compile cache {root} is read-only and empty; compiling without "
                   "a persistent cache.")
        return State("off")

    def give_up(self, err: BaseException, state: State) -> bool:
        """Whether `err` is the cache failing to be written (a full or read-only disk, a
        folder this user cannot write): then the cache is off for this process, with one
        warning, and the caller compiles without it. A compile never fails for its cache."""
        if state.root is None:
            return False
        seen: BaseException | None = err
        while seen is not None and not (isinstance(seen, OSError) and seen.errno in _CANNOT_WRITE):
            seen = seen.__cause__ or seen.__context__
        if seen is None:
            return False
        self._unwritable = state.root
        _warn_once(f"neuron compile cache {state.root} cannot be written ({seen.strerror or seen}"
                   "); compiling without the persistent cache in this process. Free space "
                   "there or set TORCH_NEURONX_NEFF_CACHE_DIR to a writable directory.")
        return True

    def private_tmp(self) -> Path:
        """A directory only this process uses, for compiles that must not be cached."""
        if self._private_tmp is None or not self._private_tmp.is_dir():
            self._private_tmp = Path(tempfile.mkdtemp(prefix="neuronlocal-inductor-"))
            import atexit

            atexit.register(shutil.rmtree, self._private_tmp, True)
        return self._private_tmp

    def read_only_view(self, state: State) -> Path:
        """A private directory that shows a read-only cache's artifacts (as links) next to
        writable lock files: Inductor takes a lock before loading compiled code, so a hit in
        a read-only cache needs somewhere to put it."""
        view = self.private_tmp() / "read-only-view"
        (view / "locks").mkdir(parents=True, exist_ok=True)
        for child in state.inductor_dir.iterdir():  # type: ignore[union-attr]
            link = view / child.name
            if child.name != "locks" and not link.exists():
                link.symlink_to(child)
        return view

    def entry_path(self, root: Path, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"invalid cache key {key!r}")
        return root / f"{key}{ENTRY_SUFFIX}"

    # ---- concurrency -------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: str, state: State) -> Iterator[None]:
        """Serialises compiles of `key` across processes (flock: released if one dies)."""
        if state.mode != "rw":
            yield
            return
        where = lock_dir()
        problem = private_dir(where, "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR")
        if problem:
            _warn_once(f"neuron compile locks disabled: {problem}.")
            yield
            return
        path = where / f"{key}.lock"
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as err:
            if err.errno == errno.ELOOP:
                _warn_once(f"neuron compile lock {path} is a symbolic link; not following it.")
            yield
            return
        deadline = time.monotonic() + lock_timeout()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise CacheLockTimeout(
                            f"waited {lock_timeout():.0f}s for the compile lock {path} held by "
                            "another process; raise TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT."
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # also releases the flock

    # ---- entries -----------------------------------------------------------------------
    def lookup(self, key: str, state: State) -> Entry | None:
        """The verified entry for `key`, or None; a corrupt one is removed (when writable)."""
        if state.root is None:
            return None
        path = self.entry_path(state.root, key)
        if not os.path.lexists(path):
            return None
        try:
            raw = read_json(path, MAX_ENTRY_BYTES)
            if not isinstance(raw, dict) or not isinstance(raw.get("files"), dict):
                raise ValueError("not an entry")
            if raw.get("format") != FORMAT or raw.get("key") != key:
                raise ValueError("wrong format or key")
            entry = Entry(key, str(raw["graph_name"]), dict(raw["files"]), float(raw["created"]))
            for rel, digest in entry.files.items():
                f = inside(state.inductor_dir, rel)  # type: ignore[arg-type]
                if f is None:
                    raise ValueError(f"artifact name {rel!r} points outside the cache")
                if not f.is_file() or f.is_symlink() or _sha256(f) != digest:
                    raise ValueError(f"artifact {rel} is missing or its checksum differs")
        except Exception as err:  # noqa: BLE001 - any failure: remove it and recompile
            _warn_once(f"neuron compile cache entry {path} is corrupt ({err}); "
                       "recompiling." + (" Removing it." if state.mode == "rw" else ""))
            if state.mode == "rw":
                self.remove(key, state)
            return None
        return entry

    @contextlib.contextmanager
    def claim(self, key: str, state: State) -> Iterator[Entry | None]:
        """The verified entry of `key` (None: compile it), holding the compile lock only
        when there is no entry yet: a warm hit never waits for a stuck compiler."""
        entry = self.lookup(key, state)
        if entry is not None:
            yield entry
            return
        with self.lock(key, state):
            yield self.lookup(key, state)

    def remove(self, key: str, state: State) -> None:
        """Removes an entry and the artifacts it names (only files inside the cache)."""
        if state.root is None:
            return
        path = self.entry_path(state.root, key)
        with contextlib.suppress(Exception):
            for rel in read_json(path, MAX_ENTRY_BYTES).get("files", {}):
                f = inside(state.inductor_dir, rel)  # type: ignore[arg-type]
                if f is not None and not f.is_symlink():
                    with contextlib.suppress(OSError):
                        f.unlink()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def snapshot(self, state: State) -> set[Path]:
        """Artifact files now in the Inductor directory (to see what a compile adds)."""
        root = state.inductor_dir
        if root is None or not root.exists():
            return set()
        return {p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                and not p.name.endswith((".lock", ".tmp"))}

    def store(self, key: str, graph_name: str, before: set[Path] | None, state: State) -> None:
        """Writes the entry of `key`, naming the artifacts made since `before` (None: a graph
        of the eager compiler, which leaves no artifacts)."""
        if state.mode != "rw":
            return
        root = state.inductor_dir
        new = [] if before is None else sorted(self.snapshot(state) - before)
        files = {str(p.relative_to(root)): _sha256(p) for p in new}  # type: ignore[arg-type]
        entry = {"format": FORMAT, "key": key, "graph_name": graph_name, "files": files,
                 "created": time.time()}
        try:
            write_private(self.entry_path(state.root, key),  # type: ignore[arg-type]
                          json.dumps(entry, indent=1))
        except OSError as err:
            if not self.give_up(err, state):
                raise

    def mark(self, key: str, graph_name: str) -> str:
        """"hit" when `key` has an entry (this process or on disk), else records one and says
        "miss": the cache semantics of a graph the eager compiler runs, whose compile leaves
        no artifact (on Trainium, a hit skips neuronx-cc)."""
        if key in self.memory:
            return "hit"
        state = self.state()
        if state.mode == "off":
            return "miss"
        if state.mode == "rw":
            self.memory[key] = True
        if self.lookup(key, state) is not None:
            return "hit"
        self.store(key, graph_name, None, state)
        return "miss"


_STOCK_PRECOMPILE: Any = None  # Inductor's own _precompile_header, before any patch
_PRECOMPILE_IN: dict[str, Any] = {}


def _precompile_header_in(header_dir: str) -> Any:
    """Inductor's header precompiler with its memo kept per header folder, so a header a
    stock compile made in the shared folder is never handed to a neuron compile."""
    import functools

    from torch._inductor import codecache

    global _STOCK_PRECOMPILE
    if _STOCK_PRECOMPILE is None:
        _STOCK_PRECOMPILE = codecache._precompile_header
    if header_dir not in _PRECOMPILE_IN:
        _PRECOMPILE_IN[header_dir] = functools.cache(_STOCK_PRECOMPILE.__wrapped__)
    return _PRECOMPILE_IN[header_dir]


def header_dir() -> Path:
    """Precompiled headers of neuron compiles: one private folder per user (headers depend
    only on the compiler and its flags, so every cache directory shares them)."""
    return Path(tempfile.gettempdir()) / f"neuron_headers_{_user()}"


_compiler_tmp: Path | None = None


def compiler_tmp() -> Path | None:
    """The C++ compiler's TMPDIR for this process: `neuron_cc_tmp_<user>/<pid>` (private,
    removed at exit). g++ killed with this process (kill -9) cannot remove its temporaries,
    so the first compile of each process also removes the folders of processes that are
    gone. None (the compiler's default) when the parent folder cannot be used."""
    global _compiler_tmp
    if _compiler_tmp is not None and _compiler_tmp.is_dir():
        return _compiler_tmp
    root = Path(tempfile.gettempdir()) / f"neuron_cc_tmp_{_user()}"
    if private_dir(root, "the compiler's temporary folder"):
        return None
    for old in root.iterdir():
        if old.name.isdigit() and not os.path.exists(f"/proc/{old.name}"):
            shutil.rmtree(old, ignore_errors=True)
    mine = root / str(os.getpid())
    with contextlib.suppress(FileExistsError):
        mine.mkdir(mode=0o700)
    import atexit

    atexit.register(shutil.rmtree, mine, True)
    _compiler_tmp = mine
    return mine


class _CompilerProcesses(types.ModuleType):
    """`subprocess` as Inductor's C++ builder sees it during a neuron compile: g++ is killed
    when this process dies (kill -9 included) instead of running on orphaned, and keeps its
    temporaries in `compiler_tmp()`, where the next process removes what it left."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def run(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("preexec_fn", killed_with_parent)
        tmp = compiler_tmp()
        if tmp is not None:
            env = kwargs.get("env")
            kwargs["env"] = {**(os.environ if env is None else env), "TMPDIR": str(tmp)}
        return subprocess.run(*args, **kwargs)


def _private_inductor_paths(target: Path) -> contextlib.ExitStack:
    """Inductor's folders that ignore TORCHINDUCTOR_CACHE_DIR (precompiled headers and their
    locks, kept in `default_cache_dir()`, a predictable temp path anyone can pre-create and
    fill) pointed at private folders: `header_dir()` (checked like the cache; refused, no
    header is precompiled) and `target`; and the C++ compiler killed with this process."""
    from unittest import mock

    from torch._inductor import codecache, cpp_builder
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime import cache_dir_utils, runtime_utils

    headers = header_dir()
    stack = contextlib.ExitStack()
    problem = private_dir(headers, "the precompiled-header folder")
    if problem:
        _warn_once(f"neuron compiles precompile no headers: {problem}.")
        stack.enter_context(inductor_config.patch(cpp_cache_precompile_headers=False))
    for module in (codecache, runtime_utils, cache_dir_utils):
        stack.enter_context(mock.patch.object(module, "default_cache_dir", lambda: str(target)))
    stack.enter_context(mock.patch.object(cpp_builder, "subprocess",
                                          _CompilerProcesses("subprocess")))
    stack.enter_context(mock.patch.object(codecache, "_HEADER_DIR", str(headers)))
    stack.enter_context(mock.patch.object(codecache, "_HEADER_LOCK_DIR", str(headers / "locks")))
    stack.enter_context(mock.patch.object(codecache, "_precompile_header",
                                          _precompile_header_in(str(headers))))
    return stack


@contextlib.contextmanager
def inductor_dirs(cache: NeffCache, state: State, cacheable: bool) -> Iterator[None]:
    """Points every folder Inductor reads or writes at the NEFF cache (or at a private
    directory, uncached): its caches, kernel and lock folders through
    TORCHINDUCTOR_CACHE_DIR, its precompiled headers at `header_dir()`.

    `cacheable`: whether this compile may read the persistent cache (a read-only cache
    serves hits only; a miss there compiles in a private directory).
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    use = state.inductor_dir if (state.inductor_dir is not None and cacheable) else None
    if use is not None and state.mode == "ro":
        use = cache.read_only_view(state)
    target = use or cache.private_tmp()
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(target)
    try:
        with inductor_config.patch(force_disable_caches=use is None), \
                functorch_config.patch(enable_autograd_cache=use is not None), \
                _private_inductor_paths(target):
            yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def graph_key(code: str, inputs_meta: list[Any], extra: dict[str, Any]) -> str:
    """Hash of the graph (`fingerprint.graph_text`), the input metadata and the versions
    that affect codegen (lowering fixes included: an entry compiled before a fix is never
    looked up)."""
    import torch

    from neuronlocal.core import VERSION

    # Each rank runs on its own core: the key names the device type, not the core, so SPMD
    # ranks compiling one graph share its key (and its cache entry), as on Trainium.
    code = _CORE_INDEX.sub(r"\1", code)
    h = hashlib.sha256()
    for part in (code, repr(inputs_meta), repr(sorted(extra.items())), torch.__version__,
                 VERSION, str(FORMAT), str(LOWERING_FIXES)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


class ArtifactType(Enum):
    """The kinds of compiled artifact whose cache keys a process tracks (TorchNeuron's
    MegaCache artifact types; a compiled graph here is one NEFF there)."""

    NEURON_NEFF = "neuron_neff"


_compiled_keys: dict[ArtifactType, set[str]] = {t: set() for t in ArtifactType}
_keys_lock = threading.Lock()


def _keys_of(artifact_type: ArtifactType) -> set[str]:
    if not isinstance(artifact_type, ArtifactType):
        raise KeyError(f"unknown artifact type {artifact_type!r}: pass one of "
                       f"{[str(t) for t in ArtifactType]}")
    return _compiled_keys[artifact_type]


def add_compiled_cache_key(key: str) -> None:
    """Records the key of a graph this process compiled or took from the cache."""
    with _keys_lock:
        _compiled_keys[ArtifactType.NEURON_NEFF].add(key)


def get_compiled_cache_keys(artifact_type: ArtifactType) -> frozenset[str]:
    """The cache keys of the graphs compiled in this process since the last clear. A graph's
    key depends on the graph alone, not the rank, so SPMD ranks list the same keys."""
    with _keys_lock:
        return frozenset(_keys_of(artifact_type))


def clear_compiled_cache_keys(artifact_type: ArtifactType | None = None) -> None:
    """Forgets the tracked keys of one artifact type, or of all (None)."""
    with _keys_lock:
        for t in ArtifactType if artifact_type is None else (artifact_type,):
            _keys_of(t).clear()
