"""The background compiler of the tiered compiler: Inductor compiles in a child process.

The parent hands a job (a graph's CPU copy, its inputs' layouts, the cache key, the config
patches) to one child at a time; the child compiles it through the persistent compile
cache and exits, and the parent later loads the entry from that cache (compile/tiered.py).

The child runs `python -m neuronlocal.compile.worker JOB PID` with the parent's environment
(its thread count too: Inductor's C++ code is built for it) and a cap on its memory
(NEURONLOCAL_TIER_WORKER_MEMORY). It is killed when the parent dies (prctl) and at the
parent's exit, so it never outlives or delays it.
Job files live in a folder only this user can read (created with mode 0700, never reused),
and the child reads nothing else from it. A job that fails leaves its graph in the first
tier: the parent logs one line with the child's last message.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronlocal.core.config import env_size
from neuronlocal.core.process import die_with_parent

log = logging.getLogger("neuronlocal.compile")
_TAIL = 2000  # bytes of a failed child's stderr kept for its log line


@dataclass
class Job:
    """One background compile; `done` is set when the child has exited (ok or not)."""

    name: str
    payload: bytes
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    peak_rss_bytes: int = 0

    def wait(self) -> bool:
        """Waits for the compile (starting it if it is still queued); whether it succeeded."""
        self.done.wait()
        return self.ok


class _Pool:
    """Runs queued jobs in child processes, one at a time (memory and CPU stay bounded)."""

    def __init__(self) -> None:
        self.queue: deque[Job] = deque()
        self.lock = threading.Lock()
        self.child: subprocess.Popen[bytes] | None = None
        self.thread: threading.Thread | None = None
        self.folder: Path | None = None
        self.closed = False

    def submit(self, job: Job) -> Job:
        with self.lock:
            if self.closed:
                job.error = "the process is exiting"
                job.done.set()
                return job
            self.queue.append(job)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._drain, name="neuron-tier-compile",
                                               daemon=True)
                self.thread.start()
        return job

    def _folder(self) -> Path:
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="neuronlocal-tier-"))  # mode 0700
        return self.folder

    def _drain(self) -> None:
        while True:
            with self.lock:
                if not self.queue or self.closed:
                    return
                job = self.queue.popleft()
            try:
                self._run(job)
            except Exception as e:  # noqa: BLE001 - a background compile never fails a step
                job.error = f"{type(e).__name__}: {e}"
            finally:
                if not job.ok:
                    log.warning("neuron: the background compile of %s failed; the graph stays "
                                "in the first tier (%s)", job.name, job.error.strip()[-300:])
                job.done.set()

    def _run(self, job: Job) -> None:
        fd, path = tempfile.mkstemp(prefix="job-", suffix=".pkl", dir=self._folder())
        with os.fdopen(fd, "wb") as f:
            f.write(job.payload)
        start = time.perf_counter()
        with self.lock:
            if self.closed:
                return
            self.child = subprocess.Popen(
                [sys.executable, "-m", "neuronlocal.compile.worker", path, str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                env=dict(os.environ))
            child = self.child
        _, err = child.communicate()
        with contextlib.suppress(OSError):
            os.unlink(path)
        job.seconds = time.perf_counter() - start
        job.peak_rss_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        job.ok = child.returncode == 0
        if not job.ok:
            tail = err[-_TAIL:].decode(errors="replace").strip().splitlines()
            job.error = (tail[-1] if tail else "") + f" (exit status {child.returncode})"

    def close(self) -> None:
        """At exit: kill the running child, drop the queue, remove the job folder."""
        with self.lock:
            self.closed = True
            queued = list(self.queue)
            self.queue.clear()
            child = self.child
        for job in queued:
            job.error = "the process exited first"
            job.done.set()
        if child is not None and child.poll() is None:
            child.kill()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


_POOL = _Pool()
atexit.register(_POOL.close)


def submit(name: str, payload: dict[str, Any]) -> Job:
    """Queues a background compile of `payload` (see `main`); returns its job at once. A
    payload that cannot be pickled fails the job (the graph stays in the first tier)."""
    try:
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - some graphs cannot travel: they stay in tier 1
        job = Job(name, b"", error=f"the graph cannot be sent to the compiler: {e}")
        log.warning("neuron: %s stays in the first tier: %s", name, job.error)
        job.done.set()
        return job
    return _POOL.submit(Job(name, data))


def _limit_memory() -> None:
    limit = env_size("NEURONLOCAL_TIER_WORKER_MEMORY")
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _idle_priority() -> None:
    """The compile takes only CPU time the training process leaves idle (Linux SCHED_IDLE,
    else the lowest nice level; its C++ build inherits it): at normal priority it competes
    with the step's intra-op threads, which on a small host slowed every first-tier step
    about threefold while the compile ran. A host with no idle CPU makes the switch call
    wait for the compile instead, which is the documented behaviour anyway."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    with contextlib.suppress(OSError):
        os.nice(19)


def _read_job(path: str) -> Any:
    """The job file, loaded only if it and its folder are this user's and private to them
    (the folder is the parent's mkdtemp), never through a symlink."""
    folder = os.stat(os.path.dirname(path), follow_symlinks=False)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        for what, s in (("folder", folder), ("file", st)):
            if s.st_uid != os.getuid() or s.st_mode & 0o077:
                raise PermissionError(f"the job {what} of {path} is not private to this user")
        return pickle.load(f)  # noqa: S301 - checked above: this user's own private file


def main(argv: list[str]) -> int:
    """The child: compiles one job file and exits 0, or raises (exit 1, message on stderr)."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != int(argv[1]):  # the parent died before prctl took effect
        return 1
    _limit_memory()
    _idle_priority()
    import torch

    from neuronlocal.compile.static import InductorJob, run_inductor_job

    payload = _read_job(argv[0])
    examples = [torch.empty_strided(s, st, dtype=getattr(torch, d)).requires_grad_(g)
                if isinstance(s, tuple) else v
                for s, st, d, g, v in payload["inputs"]]
    gm = pickle.loads(payload["gm"])  # noqa: S301 - inside the checked job file
    job = InductorJob(payload["key"], gm, examples, payload["patches"],
                      payload["grad"])
    with torch.set_grad_enabled(payload["grad"]):
        run_inductor_job(job, payload["name"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
