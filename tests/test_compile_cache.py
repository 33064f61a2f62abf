"""The persistent compile cache: private directories, safe entries and locks, warm restarts,
read-only and disabled caches, concurrent ranks, killed compilers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from neuronlocal.compile import cache as cache_mod
from neuronlocal.compile import fingerprint
from neuronlocal.compile.cache import INDUCTOR_DIR, CacheLockTimeout, NeffCache, State
from neuronlocal.core import files

pytestmark = pytest.mark.timeout(900)
OTHER_UID = 65534  # nobody


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(cache_mod, "_warned", set())
    # These tests are about the artifacts Inductor keeps in the cache (code that runs in the
    # process): they compile with Inductor. The default compiler's entries are tested below.
    monkeypatch.setenv("NEURONLOCAL_COMPILER", "inductor")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff"),
            "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "locks"), **extra}


_COMPILE = """
import json, torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to("neuron")
out = torch.compile(m, backend="neuron")(torch.ones(2, 8, device="neuron"))
out.sum().backward()
print(json.dumps([g["cache"] for g in torch.neuron.get_dynamo_metrics()["graphs"]]))
"""


def _compile_in_new_process(env: dict[str, str], unprivileged: bool = False,
                            code: str = _COMPILE) -> tuple[list[str], str]:
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    if unprivileged:
        cmd = [*_UNPRIVILEGED, *cmd]
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


# Root ignores file modes; without these capabilities it obeys them like any user, so a
# read-only directory is really read-only for the child.
_UNPRIVILEGED = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner",
                 "--inh-caps=-all", "--"] if os.getuid() == 0 else []
_needs_setpriv = pytest.mark.skipif(
    os.getuid() == 0 and shutil.which("setpriv") is None,
    reason="running as root without setpriv: cannot make a directory read-only for the test")


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


# ---- where the cache lives ----------------------------------------------------------------


def test_default_directories_are_per_user_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_NEURONX_NEFF_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    user = cache_mod._user()
    assert cache_mod.cache_dir() == tmp_path / f"neff_cache_{user}"
    assert cache_mod.lock_dir() == tmp_path / f"local_cache_{user}"
    state = NeffCache().state()
    assert state.mode == "rw" and state.root == cache_mod.cache_dir()
    assert stat.S_IMODE(os.stat(state.root).st_mode) == 0o700
    with NeffCache().lock("ab" * 10, state):
        lock = cache_mod.lock_dir() / f"{'ab' * 10}.lock"
        assert stat.S_IMODE(os.stat(lock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(cache_mod.lock_dir()).st_mode) == 0o700


def test_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(shared))
    with pytest.warns(UserWarning, match=r"can be written by other users.*chmod go-w"):
        assert NeffCache().state().mode == "off"


def test_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, OTHER_UID, OTHER_UID)
    else:
        theirs = Path("/usr")  # owned by root, not writable by others
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(theirs))
    with pytest.warns(UserWarning, match=r"owned by uid \d+, not by you"):
        assert NeffCache().state().mode == "off"


def test_planted_code_in_a_refused_directory_is_never_used(tmp_path, fresh_python):
    """Another user's cache directory is not read: the compile ignores it and caches nothing
    there (so nothing planted in it can run)."""
    planted = tmp_path / "neff"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    (planted / INDUCTOR_DIR).mkdir()
    before = _files(planted)
    caches, err = _compile_in_new_process(_env(tmp_path))
    assert caches == ["miss"] and "can be written by other users" in err
    assert _files(planted) == before


# ---- entries and locks ---------------------------------------------------------------------


def _rw_state(tmp_path: Path, monkeypatch) -> State:
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "neff"))
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "locks"))
    state = NeffCache().state()
    assert state.mode == "rw"
    return state


@pytest.mark.parametrize("name", ["../../victim", "ABSOLUTE", "sub/../../victim", "link/x"])
def test_crafted_entry_never_touches_files_outside(tmp_path, monkeypatch, name):
    state = _rw_state(tmp_path, monkeypatch)
    victim = tmp_path / "victim"
    victim.write_text("user data")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x").write_text("more user data")
    (state.inductor_dir / "link").symlink_to(outside)
    if name == "ABSOLUTE":
        name = str(victim)
    key = "c" * 40
    entry = {"format": cache_mod.FORMAT, "key": key, "graph_name": "g", "created": 0,
             "files": {name: "0" * 64}}
    (state.root / f"{key}.neff").write_text(json.dumps(entry))
    with pytest.warns(UserWarning, match="corrupt"):
        assert NeffCache().lookup(key, state) is None
    assert victim.read_text() == "user data"
    assert (outside / "x").read_text() == "more user data"
    assert not (state.root / f"{key}.neff").exists()


def test_corrupt_artifact_inside_is_removed_with_its_entry(tmp_path, monkeypatch):
    state = _rw_state(tmp_path, monkeypatch)
    art = state.inductor_dir / "ab" / "code.py"
    art.parent.mkdir()
    art.write_text("print('hi')")
    key = "d" * 40
    entry = {"format": cache_mod.FORMAT, "key": key, "graph_name": "g", "created": 0,
             "files": {"ab/code.py": "0" * 64}}
    (state.root / f"{key}.neff").write_text(json.dumps(entry))
    with pytest.warns(UserWarning, match="checksum differs"):
        assert NeffCache().lookup(key, state) is None
    assert not art.exists() and not (state.root / f"{key}.neff").exists()


def test_deeply_nested_entry_is_removed_and_recompiled(tmp_path, monkeypatch):
    state = _rw_state(tmp_path, monkeypatch)
    key = "a" * 40
    (state.root / f"{key}.neff").write_text("[" * 100000 + "]" * 100000)
    with pytest.warns(UserWarning, match="corrupt.*nested too deeply"):
        assert NeffCache().lookup(key, state) is None
    assert not (state.root / f"{key}.neff").exists()


def test_huge_entry_is_refused_before_it_is_read(tmp_path, monkeypatch):
    import tracemalloc

    state = _rw_state(tmp_path, monkeypatch)
    key = "b" * 40
    with (state.root / f"{key}.neff").open("wb") as f:
        f.truncate(2**30)  # 1 GiB (sparse)
    tracemalloc.start()
    try:
        with pytest.warns(UserWarning, match="corrupt.*more than"):
            assert NeffCache().lookup(key, state) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak
    assert not (state.root / f"{key}.neff").exists()


def test_verified_entry_is_served_while_another_process_holds_the_lock(tmp_path, monkeypatch):
    """A stuck compile of the same graph never blocks a warm hit: the entry is looked up
    before the lock is taken."""
    state = _rw_state(tmp_path, monkeypatch)
    key = "9" * 40
    entry = {"format": cache_mod.FORMAT, "key": key, "graph_name": "g", "created": 0,
             "files": {}}
    (state.root / f"{key}.neff").write_text(json.dumps(entry))
    (tmp_path / "locks").mkdir(mode=0o700)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "30")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / "locks" /
                                                               f"{key}.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t = time.monotonic()
        with NeffCache().claim(key, state) as found:
            assert found is not None and found.graph_name == "g"
        assert time.monotonic() - t < 5
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("mode", ["rw", "off"])
def test_inductor_folders_outside_its_cache_dir_are_redirected(tmp_path, monkeypatch, mode):
    """Inductor keeps precompiled headers (and their locks) in `default_cache_dir()`, a fixed
    temp path that ignores TORCHINDUCTOR_CACHE_DIR; a neuron compile sees them, like every
    other Inductor folder, inside the private cache (or the private uncached folder)."""
    from torch._inductor import codecache
    from torch._inductor.runtime import runtime_utils

    from neuronlocal.compile.cache import inductor_dirs

    shared = runtime_utils.default_cache_dir()
    if mode == "off":
        monkeypatch.setenv("TORCH_NEURONX_DISABLE_NEFF_CACHE", "1")
    cache = NeffCache()
    state = _rw_state(tmp_path, monkeypatch) if mode == "rw" else cache.state()
    with inductor_dirs(cache, state, cacheable=True):
        target = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        assert files.private_dir(target, "target", create=False) is None
        seen = [codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR,
                runtime_utils.default_cache_dir(), codecache.default_cache_dir(),
                codecache.get_lock_dir()]
        headers = cache_mod.header_dir()
        assert files.private_dir(headers, "headers", create=False) is None
        for path in seen[:2]:
            assert Path(path).resolve().is_relative_to(headers.resolve()), path
        for path in seen[2:]:
            assert Path(path).resolve().is_relative_to(target.resolve()), path
        assert codecache._precompile_header is not cache_mod._STOCK_PRECOMPILE
    assert codecache._HEADER_DIR == os.path.join(shared, "precompiled_headers")
    assert runtime_utils.default_cache_dir() == shared


@pytest.mark.slow
@pytest.mark.parametrize("disabled", ["0", "1"])
def test_planted_header_folder_is_never_used(tmp_path, disabled):
    """Another user pre-creates Inductor's shared header folder (mode 777); a neuron compile
    neither reads nor writes it, with the cache on or off."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    user = subprocess.run([sys.executable, "-c", "import getpass; print(getpass.getuser())"],
                          capture_output=True, text=True).stdout.strip()
    planted = tmp / f"torchinductor_{user}" / "precompiled_headers"
    planted.mkdir(parents=True)
    for d in (planted.parent, planted):
        d.chmod(0o777)
    (planted / "locks").mkdir(mode=0o777)
    env = _env(tmp_path, TMPDIR=str(tmp), TORCH_NEURONX_DISABLE_NEFF_CACHE=disabled,
               TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="1")
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    caches, err = _compile_in_new_process(env)
    assert caches, err
    assert _files(planted.parent) == set(), _files(planted.parent)
    assert any(p.suffix == ".gch" for p in _files(tmp / f"neuron_headers_{user}"))


def test_header_folder_others_can_write_turns_precompiled_headers_off(tmp_path, monkeypatch):
    from torch._inductor import config as inductor_config

    from neuronlocal.compile.cache import inductor_dirs

    monkeypatch.setattr(cache_mod, "header_dir", lambda: tmp_path / "headers")
    (tmp_path / "headers").mkdir(mode=0o777)
    (tmp_path / "headers").chmod(0o777)
    state = _rw_state(tmp_path, monkeypatch)
    with pytest.warns(UserWarning, match="precompile no headers.*can be written by other"):
        with inductor_dirs(NeffCache(), state, cacheable=True):
            assert inductor_config.cpp_cache_precompile_headers is False


_COMPILER_CHILD = """
import os, sys, tempfile
from torch._inductor import cpp_builder
from neuronlocal.compile.cache import NeffCache, inductor_dirs
cache = NeffCache()
with inductor_dirs(cache, cache.state(), cacheable=True):
    print(os.getpid(), flush=True)
    cpp_builder._run_compile_cmd("sleep 300", tempfile.gettempdir())  # stands in for g++
"""


def _children(pid: int) -> list[int]:
    """Child pids of `pid` from /proc, skipping its threads that end while being read."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_compiler_child_dies_with_a_killed_compile(tmp_path):
    """kill -9 of a process compiling a graph takes its C++ compiler with it."""
    proc = subprocess.Popen([sys.executable, "-c", _COMPILER_CHILD], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **_env(tmp_path)})
    try:
        pid = int(proc.stdout.readline())
        deadline = time.monotonic() + 60
        children: list[int] = []
        while not children and time.monotonic() < deadline:
            children = _children(pid)
            time.sleep(0.1)
        assert children, "the compiler never started"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{children[0]}").exists() and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(children[0], os.WNOHANG)
        status = Path(f"/proc/{children[0]}/stat")
        if status.exists() and status.read_text().split()[2] == "Z":
            break  # a zombie: dead, waiting for its new parent to reap it
        time.sleep(0.1)
    alive = Path(f"/proc/{children[0]}/stat")
    assert not alive.exists() or alive.read_text().split()[2] == "Z", "the compiler outlived it"


_COMPILER_TEMPORARY = """
import os, sys, tempfile
from torch._inductor import cpp_builder
from neuronlocal.compile.cache import NeffCache, inductor_dirs
cache = NeffCache()
with inductor_dirs(cache, cache.state(), cacheable=True):
    print(os.getpid(), flush=True)
    cpp_builder._run_compile_cmd(sys.argv[1], tempfile.gettempdir())  # stands in for g++
"""


def test_temporaries_of_a_killed_compile_are_removed_by_the_next(tmp_path):
    """kill -9 during a compile: g++ dies with the process and cannot remove its temporary
    files; they are in the process's own compiler folder, which the next compile removes."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, **_env(tmp_path), "TMPDIR": str(tmp)}
    compiler = "sh -c 'mktemp ccXXXXXX.o --tmpdir; sleep 300'"  # a temporary, then a long build
    proc = subprocess.Popen([sys.executable, "-c", _COMPILER_TEMPORARY, compiler],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        proc.stdout.readline()
        deadline = time.monotonic() + 60
        while not list(tmp.rglob("cc*.o")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(tmp.rglob("cc*.o")), "the compiler never wrote its temporary"
    finally:
        proc.kill()
        proc.wait()
    time.sleep(0.5)  # the compiler gets its SIGKILL
    r = subprocess.run([sys.executable, "-c", _COMPILER_TEMPORARY, "true"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list(tmp.rglob("cc*.o"))


def test_lock_file_symlink_is_not_followed(tmp_path, monkeypatch):
    state = _rw_state(tmp_path, monkeypatch)
    (tmp_path / "locks").mkdir(mode=0o700)
    target = tmp_path / "precious"
    target.write_text("keep me")
    key = "e" * 40
    (tmp_path / "locks" / f"{key}.lock").symlink_to(target)
    target.chmod(0o644)
    with pytest.warns(UserWarning, match="symbolic link; not following"):
        with NeffCache().lock(key, state):
            pass
    assert target.read_text() == "keep me"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_killed_compiler_leaves_no_blocking_lock(tmp_path, monkeypatch):
    """A rank killed while it holds a compile lock does not block the next run: the kernel
    drops its flock with the process."""
    state = _rw_state(tmp_path, monkeypatch)
    key = "f" * 40
    lock_path = tmp_path / "locks" / f"{key}.lock"
    (tmp_path / "locks").mkdir(mode=0o700)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "2")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock_path)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    t = time.monotonic()
    with pytest.raises(CacheLockTimeout, match="TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT"):
        with NeffCache().lock(key, state):
            pass
    assert 1.5 < time.monotonic() - t < 30
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    t = time.monotonic()
    with NeffCache().lock(key, state):
        assert time.monotonic() - t < 1.0


# ---- warm, read-only and disabled caches ---------------------------------------------------


def test_warm_restart_hits_inductor_caches(tmp_path):
    cold, _ = _compile_in_new_process(_env(tmp_path))
    assert cold == ["miss"]
    code = _COMPILE.replace("print(json.dumps(", "from torch._dynamo.utils import counters\n"
                            "print(counters['aot_autograd']['autograd_cache_hit'])\nprint(json.dumps(")
    full = {**os.environ, **_env(tmp_path)}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    hits, caches = r.stdout.strip().splitlines()[-2:]
    assert int(hits) == 1 and json.loads(caches) == ["hit"]


@_needs_setpriv
def test_read_only_warm_cache_still_hits(tmp_path):
    env = _env(tmp_path)
    _compile_in_new_process(env)
    root = tmp_path / "neff"
    before = {p: p.stat().st_mtime_ns for p in _files(root)}
    dirs = [p for p in [root, *root.rglob("*")] if p.is_dir()]
    for p in dirs:
        p.chmod(0o500)
    try:
        caches, err = _compile_in_new_process(env, unprivileged=True)
    finally:
        for p in dirs:
            p.chmod(0o700)
    assert caches == ["hit"], err[-2000:]
    assert {p: p.stat().st_mtime_ns for p in _files(root)} == before


@_needs_setpriv
def test_read_only_empty_cache_compiles_uncached(tmp_path):
    root = tmp_path / "neff"
    root.mkdir(mode=0o500)
    caches, err = _compile_in_new_process(_env(tmp_path), unprivileged=True)
    assert caches == ["miss"] and "read-only and empty" in err
    assert not _files(root)


def test_disabled_cache_writes_nothing(tmp_path):
    caches, _ = _compile_in_new_process(_env(tmp_path, TORCH_NEURONX_DISABLE_NEFF_CACHE="1"))
    assert caches == ["miss"]
    assert not _files(tmp_path / "neff") and not _files(tmp_path / "locks")
    caches, _ = _compile_in_new_process(_env(tmp_path, TORCH_NEURONX_DISABLE_NEFF_CACHE="1"))
    assert caches == ["miss"]


@pytest.mark.slow  # two Inductor compiles; the fast corrupt-entry tests above cover the rule
def test_unreadable_entry_is_replaced(tmp_path):
    """A truncated entry is reported and rewritten; Inductor's intact artifacts still serve."""
    _compile_in_new_process(_env(tmp_path))
    entries = list((tmp_path / "neff").glob("*.neff"))
    assert entries
    for e in entries:
        e.write_bytes(e.read_bytes()[:10])
    again, err = _compile_in_new_process(_env(tmp_path))
    assert again == ["hit"] and "corrupt" in err
    assert all(json.loads(e.read_bytes())["key"] for e in (tmp_path / "neff").glob("*.neff"))


def test_corrupt_artifact_recompiles(tmp_path):
    """An artifact whose checksum differs (a truncated shared object, say) is removed with its
    entry, and the graph compiles again instead of loading it."""
    _compile_in_new_process(_env(tmp_path))
    root = tmp_path / "neff"
    entry = json.loads(next(root.glob("*.neff")).read_bytes())
    libs = [rel for rel in entry["files"] if rel.endswith(".so")]
    assert libs, entry["files"]
    for rel in libs:
        art = root / INDUCTOR_DIR / rel
        art.write_bytes(art.read_bytes()[:100])
    again, err = _compile_in_new_process(_env(tmp_path))
    assert again == ["miss"] and "checksum differs" in err
    fresh = json.loads(next(root.glob("*.neff")).read_bytes())
    assert fresh["files"], "the recompile must list its artifacts again"
    for rel in fresh["files"]:
        assert (root / INDUCTOR_DIR / rel).stat().st_size > 100 or not rel.endswith(".so")


def test_four_ranks_compile_once(tmp_path):
    """torchrun with 4 ranks compiling one graph into one cache: one compiles, three wait
    for its lock and hit."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_COMPILE).replace("print(json.dumps(",
                                                        "print('CACHE', json.dumps("))
    env = {**os.environ, **_env(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        "--tee", "1", str(script)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    states = [json.loads(line.split("CACHE", 1)[1]) for line in r.stdout.splitlines()
              if "CACHE" in line]
    flat = sorted(s for ss in states for s in ss)
    assert flat == ["hit", "hit", "hit", "miss"], r.stdout[-2000:]


def test_lookup_of_invalid_key_is_refused(tmp_path, monkeypatch):
    state = _rw_state(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="invalid cache key"):
        NeffCache().lookup("../../etc/passwd", state)


def test_cache_state_warns_once(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(shared))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        NeffCache().state()
        NeffCache().state()
    assert len([w for w in seen if "other users" in str(w.message)]) == 1
    assert torch.neuron.is_available()


def test_default_compiler_entries_hit_in_a_new_process(tmp_path):
    """The default compiler leaves an entry per graph and no artifact: a new process reports
    the graph as a hit (Trainium would skip neuronx-cc) and nothing executable is cached."""
    env = _env(tmp_path, NEURONLOCAL_COMPILER="eager")
    assert _compile_in_new_process(env)[0] == ["miss"]
    assert _compile_in_new_process(env)[0] == ["hit"]
    entries = list((tmp_path / "neff").glob("*.neff"))
    assert len(entries) == 1 and json.loads(entries[0].read_text())["files"] == {}
    assert not [p for p in (tmp_path / "neff").rglob("*") if p.is_file() and p.suffix != ".neff"]


# ---- the compiled-graph cache keys (TorchNeuron's neuron_dynamo_backend.compile API) -------

@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_compiled_cache_keys_list_this_processes_graphs(tmp_path, monkeypatch, compiler):
    from torch_neuronx.neuron_dynamo_backend.cache_artifact import ArtifactType as Exported
    from torch_neuronx.neuron_dynamo_backend.compile import (
        ArtifactType,
        clear_compiled_cache_keys,
        get_compiled_cache_keys,
    )

    assert Exported is ArtifactType and ArtifactType.NEURON_NEFF.value == "neuron_neff"
    for name, value in _env(tmp_path, NEURONLOCAL_COMPILER=compiler).items():
        monkeypatch.setenv(name, value)
    torch._dynamo.reset()
    clear_compiled_cache_keys()
    x = torch.ones(3, device="neuron")
    f = torch.compile(lambda v: v.sin() * 2, backend="neuron")
    f(x)
    f(x)  # no recompile: still one key
    first = get_compiled_cache_keys(ArtifactType.NEURON_NEFF)
    assert isinstance(first, frozenset) and len(first) == 1
    torch.compile(lambda v: v.cos() - 1, backend="neuron")(x)
    both = get_compiled_cache_keys(ArtifactType.NEURON_NEFF)
    assert len(both) == 2 and first < both
    graphs = torch.neuron.get_dynamo_metrics()["graphs"]
    assert both <= {g["cache_key"] for g in graphs}  # the keys the graph records show
    clear_compiled_cache_keys(ArtifactType.NEURON_NEFF)
    assert get_compiled_cache_keys(ArtifactType.NEURON_NEFF) == frozenset()
    with pytest.raises(KeyError, match="unknown artifact type 'neuron_neff'"):
        get_compiled_cache_keys("neuron_neff")  # type: ignore[arg-type]


def test_graph_key_names_the_device_type_not_the_core():
    """SPMD ranks run one graph each on their own core: the key must not depend on it."""
    code = "ones = torch.ones(3, device=device(type='neuron', index={}))\ny = x.to('neuron:{}')"
    key = cache_mod.graph_key(code.format(0, 0), [], {})
    assert key == cache_mod.graph_key(code.format(3, 5), [], {})
    assert key != cache_mod.graph_key(code.format(0, 0).replace("neuron", "cpu"), [], {})


# ---- the key names the whole graph, higher-order ops' bodies included ---------------------

def _cond(body):
    return lambda v: torch.cond(v.sum() > 0, body, lambda u: u.cos(), (v,))


def _flex(score):
    from torch.nn.attention.flex_attention import flex_attention

    return lambda v: flex_attention(v, v, v, score_mod=score)


_HOPS = {
    "cond": (_cond(lambda u: u.sin()), _cond(lambda u: u.exp()), (4,)),
    "flex": (_flex(lambda s, b, h, q, k: s + 1.0), _flex(lambda s, b, h, q, k: s * (q - k)),
             (1, 1, 8, 4)),
}


@pytest.mark.parametrize("hop", sorted(_HOPS))
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_graphs_differing_only_inside_a_higher_order_op_get_their_own_keys(
        isolated_compile, monkeypatch, compiler, hop):
    """torch.cond branches and FlexAttention's score_mod are graphs of their own, called by
    name from the top-level code: two graphs that differ only there must not share a key
    (Inductor would run the first one's code; the default compiler would call it a hit)."""
    from neuronlocal.core import dynamo_metrics as metrics

    monkeypatch.setenv("NEURONLOCAL_COMPILER", compiler)
    first, second, shape = _HOPS[hop]
    x = torch.arange(float(torch.Size(shape).numel())).reshape(shape) / 10
    outs = [torch.compile(f, backend="neuron")(x.to("neuron")).cpu() for f in (first, second)]
    for f, out in zip((first, second), outs, strict=True):
        torch.testing.assert_close(out, f(x))
    graphs = metrics.get_dynamo_metrics()["graphs"]
    assert len({g["cache_key"] for g in graphs}) == 2
    assert [g["cache"] for g in graphs] == ["miss", "miss"]


def test_graph_text_covers_checkpoint_bodies_and_constants():
    """Activation-checkpoint bodies, tensor constants (layout and small values) and the
    Python functions a graph calls all change the text the key hashes."""
    from torch import fx
    from torch.utils.checkpoint import checkpoint

    def traced(body):
        gm = torch._dynamo.export(lambda v: checkpoint(body, v, use_reentrant=False))(
            torch.ones(3)).graph_module
        return fingerprint.graph_text(gm)

    assert traced(lambda u: u.sin()) != traced(lambda u: u.tanh())
    texts = set()
    for value in (torch.zeros(2), torch.ones(2), torch.zeros(3)):
        g = fx.Graph()
        g.output(g.get_attr("c"))
        root = torch.nn.Module()
        root.c = value
        texts.add(fingerprint.graph_text(fx.GraphModule(root, g)))
    assert len(texts) == 3


# ---- a cache that cannot be written is a warning, never a failed compile ------------------

_FULL_DISK = """set -e
mount -t tmpfs -o size=64k tmpfs "$1"
dd if=/dev/zero of="$1/filler" bs=4k 2>/dev/null || true
shift
exec "$@"
"""


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "tmpfs", str(where)],
                       capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_full_cache_disk_warns_once_and_compiles_without_it(tmp_path, compiler):
    """The cache folder on a full disk (a 64 KiB tmpfs, filled): the graph compiles and runs
    without the cache, with one warning naming the folder."""
    full = tmp_path / "full"
    full.mkdir()
    if not _can_mount_tmpfs(full):
        pytest.skip("cannot mount a tmpfs in a mount namespace here (unshare -m)")
    (tmp_path / "full.sh").write_text(_FULL_DISK)
    env = {**os.environ, "TORCH_NEURONX_NEFF_CACHE_DIR": str(full / "neff"),
           "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "locks"),
           "NEURONLOCAL_COMPILER": compiler}
    cmd = ["unshare", "-m", "sh", str(tmp_path / "full.sh"), str(full), sys.executable, "-c",
           textwrap.dedent(_COMPILE)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["miss"]
    assert r.stderr.count("cannot be written (No space left on device)") == 1
