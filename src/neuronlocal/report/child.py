"""The process `neuronlocal run` starts: runs the target here with capture on, then reports.

`python -m neuronlocal.report.child --report DIR --state FILE [--module M] -- args...`
runs the target through runpy (as `python script.py` / `python -m module` would) with
sys.argv set to its own arguments. While it runs, a snapshot of what was collected goes
to the state file every few seconds, so a process that dies without running Python code
(a segfault, SIGKILL) still leaves data for the supervising parent (runner.py) to report.
`os._exit()` is wrapped (as coverage.py does) to write the full report first. Every other
ending (return, sys.exit, an exception, KeyboardInterrupt) writes the report here.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import faulthandler
import importlib.util
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuronlocal.core.files import write_private
from neuronlocal.core.process import die_with_parent
from neuronlocal.report import collect

SNAPSHOT_SECONDS = 2.0  # between snapshots, or longer: a snapshot takes at most 2% of the run
_MAX_SHARE = 0.02


def write_state(path: Path, data: dict[str, Any]) -> None:
    """Atomically replaces the state file (private to the user, never through a symlink);
    runner.py removes a temporary a crash left half-written."""
    write_private(path, json.dumps(data, default=str))


class _Snapshots:
    """Writes a snapshot to the state file every SNAPSHOT_SECONDS from a daemon thread (or
    less often when a snapshot is slow, e.g. with a long memory timeline).

    A fork waits for a snapshot in progress (the C++ counters take locks, which a forked
    child must not inherit held); the thread does not exist in the forked child.
    """

    def __init__(self, state: Path, run: dict[str, Any]) -> None:
        self.state, self.run = state, run
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.wait = SNAPSHOT_SECONDS
        self.thread = threading.Thread(target=self._loop, name="neuronlocal-report",
                                       daemon=True)
        os.register_at_fork(before=self.lock.acquire, after_in_parent=self.lock.release,
                            after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.lock = threading.Lock()
        self.done.set()

    def write(self) -> None:
        with self.lock:
            if self.done.is_set():
                return
            start = time.perf_counter()
            with contextlib.suppress(Exception):  # a snapshot must never break the run
                write_state(self.state, {"status": "running", "report": collect.snapshot(
                    {**self.run, "exit_code": None, "ended_by": "running"})})
            self.wait = max(SNAPSHOT_SECONDS, (time.perf_counter() - start) / _MAX_SHARE)

    def _loop(self) -> None:
        while not self.done.wait(self.wait):
            self.write()

    def start(self) -> _Snapshots:
        self.write()
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.lock:
            self.done.set()


def _module_error(module: str) -> str | None:
    """Python's own message when `python -m module` could not start, else None."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            if importlib.util.find_spec(f"{module}.__main__") is None:
                return (f"No module named {module}.__main__; '{module}' is a package and "
                        "cannot be directly executed")
    except ImportError as e:
        return str(e)
    except ValueError:
        spec = None
    return None if spec is not None else f"No module named {module}"


def _ending(e: BaseException) -> tuple[int, dict[str, Any] | None, str]:
    """(exit status, error entry, how it ended) for an exception that ended the target."""
    if isinstance(e, SystemExit):
        code = e.code
        if code is None or isinstance(code, int):
            return int(code or 0), None, "sys.exit"
        print(code, file=sys.stderr)  # as Python prints sys.exit("message")
        return 1, {"type": "SystemExit", "message": str(code), "traceback": ""}, "sys.exit"
    traceback.print_exc()
    error = {"type": type(e).__name__, "message": str(e),
             "traceback": "".join(traceback.format_exception(e))}
    if isinstance(e, KeyboardInterrupt):
        return 130, error, "KeyboardInterrupt"
    return 1, error, "exception"


def run(argv: list[str], module: str | None, report: Path, state: Path, run_id: str,
        write: Callable[..., Any]) -> int:
    """Runs the target; returns its exit status. `write` is runner.write (report + summary)."""
    if module and (msg := _module_error(module)):
        print(f"neuronlocal run: {msg}", file=sys.stderr)
        return 1
    sys.argv = argv
    if not module:  # as `python script.py`: the script's folder first, not the cwd
        sys.path[0] = str(Path(argv[0]).resolve().parent)
    if not faulthandler.is_enabled():
        faulthandler.enable()  # a segfault prints the Python stack before the parent reports
    run_info = {"argv": argv, "run_id": run_id}
    collector = collect.Collector().start()
    snaps = _Snapshots(state, run_info).start()
    pid, real_exit, finished = os.getpid(), os._exit, threading.Event()

    def finish(code: int, error: dict[str, Any] | None, ended_by: str) -> None:
        if finished.is_set() or os.getpid() != pid:  # a forked copy of the script: not ours
            return
        finished.set()
        snaps.stop()
        with contextlib.suppress(ValueError):  # not in the main thread: cannot change it
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: keep the report
        try:
            write(report, collect.snapshot({**run_info, "exit_code": code, "error": error,
                                            "ended_by": ended_by}))
            write_state(state, {"status": "done"})
        except Exception as e:  # noqa: BLE001 - one line; the exit status stays the script's
            print(f"neuronlocal run: could not write the report to {report}: {e}",
                  file=sys.stderr)
        finally:
            collector.stop()

    def exit_hook(code: int) -> None:
        finish(code, None, "os._exit")
        real_exit(code)

    os._exit = exit_hook  # type: ignore[assignment]
    code, error, ended_by = 0, None, "return"
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except BaseException as e:  # noqa: BLE001 - report any ending, then exit like Python
        code, error, ended_by = _ending(e)
    finally:
        finish(code, error, ended_by)
        os._exit = real_exit
    return code


def main() -> None:
    from neuronlocal.report import runner

    p = argparse.ArgumentParser(prog="neuronlocal.report.child")
    p.add_argument("--report", required=True, type=Path)
    p.add_argument("--state", required=True, type=Path)
    p.add_argument("--run-id", required=True)
    p.add_argument("--module")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    argv = [a.module, *args] if a.module else args
    die_with_parent()
    code = run(argv, a.module, a.report, a.state, a.run_id, runner.write)
    # The job and its report are done: run the exit handlers (the script's and the device's),
    # flush, and end without the interpreter's teardown. Tearing down torch's C++ state after
    # a dry run was seen to abort a finished rank about once in 20 (status 134, "terminate
    # called without an active exception" on the main thread), which would turn a job that
    # succeeded into a failure. The cause in that teardown is not yet found.
    getattr(threading, "_shutdown", lambda: None)()  # the script's non-daemon threads, as exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
