"""`neuronlocal run`: run a program under a supervisor and report what it would cost.

The target runs in a child process (report/child.py) that collects while it runs and
writes the report when the target ends: returns, calls sys.exit or os._exit, raises, or is
interrupted. This process only checks the arguments (a missing script and an unwritable
report directory fail before anything runs), waits, forwards signals, and takes the exit
status. When the child dies without writing its report (a segfault, SIGKILL, a signal it
does not handle), it writes one here from the child's last snapshot (taken every few
seconds), saying how the process ended. Under torchrun every rank writes
`rank<N>.json`; then, holding a lock on the report directory, it merges the rank files
present into `report.json` and `report.html`, so the last rank to finish leaves the
complete page (and prints the merged summary).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from neuronlocal.core import hardware
from neuronlocal.core import state as core_state
from neuronlocal.core.files import private_dir, read_json, temp_prefix, write_private
from neuronlocal.report import render

log = logging.getLogger("neuronlocal.report")
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2)
_FROM_TERMINAL = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_RANK_FILE = re.compile(r"rank(0|[1-9][0-9]{0,6})\.json")  # the names `write` gives


class RunError(Exception):
    """`neuronlocal run` cannot start: its one-line message, and the exit status to use."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _target(args: list[str], module: str | None) -> tuple[str, list[str]]:
    if module:
        return module, [module, *args]
    if not args:
        raise RunError("neuronlocal run: give a script (or -m module) to run")
    script = Path(args[0])
    if not script.exists():  # the message and status of `python missing.py`
        raise RunError(f"neuronlocal run: can't open file '{script.absolute()}': [Errno 2] No "
                       "such file or directory")
    return args[0], list(args)


def _check_writable(out: Path) -> bool:
    """Creates `out` if needed and proves a file can be written there; True if created.

    The folder must be the user's own, reached through no other user's link, and writable
    by nobody else: report files are replaced by name there, which another user must not
    be able to redirect.
    """
    created = not os.path.lexists(out)
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = private_dir(out, "the report folder", create=False)
        if problem is None:
            with tempfile.TemporaryFile(dir=out):
                pass
    except OSError as e:
        raise RunError(f"neuronlocal run: cannot write the report to {out}/: "
                       f"{e.strerror or e}; pass --report with a writable directory.") from None
    if problem:
        raise RunError(f"neuronlocal run: {problem}; pass --report with a folder of your "
                       "own.")
    return created


def _terminal_sent_it_to_both() -> bool:
    """True when we are the foreground job of a terminal: a key there (Ctrl-C) signals the
    whole process group, so the child already got the signal and forwarding would double it."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def forwarding(procs: list[subprocess.Popen[bytes]]) -> dict[int, Any]:
    """Forwards this process's signals to the children in `procs` (a list the caller may
    grow); returns the previous handlers, for `restore`."""
    def forward(signum: int, _frame: Any) -> None:
        if signum in _FROM_TERMINAL and _terminal_sent_it_to_both():
            return
        for proc in list(procs):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    # A signal this process ignores (a background job of a non-interactive shell ignores
    # SIGINT) stays ignored, as it is in the child, which inherited the same disposition.
    return {s: signal.signal(s, forward) for s in _FORWARDED
            if signal.getsignal(s) is not signal.SIG_IGN}


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _finish_for_child(out: Path, state: Path, status: int, seconds: float, quiet: bool) -> int:
    """After the child ended: its exit status, and the report it could not write itself."""
    try:
        return _report_for_child(out, state, status, seconds, quiet)
    finally:
        _remove_state(state)


def _report_for_child(out: Path, state: Path, status: int, seconds: float, quiet: bool) -> int:
    try:
        data = read_json(state)
    except FileNotFoundError:
        return status  # the target never started (e.g. no such module): no report
    except (OSError, ValueError):
        data = {"status": "running", "report": None}
    code = 128 - status if status < 0 else status  # killed by signal N: 128+N, as shells say
    if data.get("status") != "done":
        rep = data.get("report")
        if rep is None:
            print(f"neuronlocal run: the process ended (status {code}) before its first "
                  f"snapshot; no report in {out}/", file=sys.stderr)
        else:
            last = (f"the report holds what was collected until its last snapshot, at "
                    f"{rep['run']['seconds']:.1f} s")
            if status < 0:
                name = _signal_name(-status)
                how = f"killed by {name}"
                note = hardware.host_memory_note(core_state.profile) \
                    if -status == signal.SIGKILL else None
                error = {"type": name, "traceback": "",
                         "message": f"the process was {how} after {seconds:.1f} s; {last}"
                                    + (f" (if memory ran out: {note})" if note else "")}
            else:
                how = f"exit {code} without writing its report"
                error = {"type": "Exit", "traceback": "",
                         "message": f"the process exited with status {code} after "
                                    f"{seconds:.1f} s without writing its report; {last}"}
            rep["run"].update(exit_code=code, error=error, ended_by=how)
            try:
                write(out, rep, quiet=quiet)
            except OSError as e:
                print(f"neuronlocal run: could not write the report to {out}/: {e}",
                      file=sys.stderr)
    return code


def _remove_state(state: Path) -> None:
    """Removes the state file and any snapshot a crash interrupted half-written."""
    for p in [state, *state.parent.glob(f"{glob.escape(temp_prefix(state))}*.tmp")]:
        with contextlib.suppress(OSError):
            p.unlink()


def _started(pid: int) -> str:
    """When process `pid` started (clock ticks since boot), so a reused pid is another."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def _parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _agent() -> int:
    """The torchrun agent that started this rank: the nearest ancestor whose environment
    has no TORCHELASTIC_RUN_ID (a shell between torchrun and `neuronlocal run` inherits
    it, torchrun itself does not). The parent when /proc cannot tell."""
    pid = os.getppid()
    for _ in range(16):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return os.getppid()
        if b"\0TORCHELASTIC_RUN_ID=" not in b"\0" + env or _parent_of(pid) <= 1:
            return pid
        pid = _parent_of(pid)
    return os.getppid()


def _run_id() -> str:
    """What names this job's rank files, unique to the job: the ranks' reports into one
    folder merge only with files of the same id. torchrun's TORCHELASTIC_RUN_ID is "none"
    for every job started with --master-port, and a fixed --rdzv-id repeats across jobs, so
    on one node the id adds the torchrun agent (`_agent`: host, pid and start time).
    Across nodes the agents differ, so the rendezvous (id, master address and port) has to
    do."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if not elastic:
        return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if os.environ.get("LOCAL_WORLD_SIZE", "") == os.environ.get("WORLD_SIZE", ""):
        agent = _agent()
        return f"{elastic}-{socket.gethostname()}-{agent}-{_started(agent)}"
    return (f"{elastic}-{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
            f"-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def restore(previous: dict[int, Any]) -> None:
    """Puts back the signal handlers `forwarding` replaced."""
    for s, handler in previous.items():
        signal.signal(s, handler)


@dataclasses.dataclass
class Child:
    """A started child: its process, and what `finish` needs to take its report."""

    proc: subprocess.Popen[bytes]
    out: Path
    state: Path
    started: float
    created: bool


def start(args: list[str], module: str | None, report_dir: str | Path, run_id: str,
          env: dict[str, str] | None = None, pipe: bool = False) -> Child:
    """Starts `script args...` (or `-m module args...`) in a child reporting to
    `report_dir`; raises RunError when it cannot start. `env`: the child's whole
    environment (default: this one's); `pipe`: its stdout and stderr come back as pipes."""
    target, argv = _target(args, module)
    out = Path(report_dir)
    created = _check_writable(out)
    state = out / f".state-{uuid.uuid4().hex}.json"
    cmd = [sys.executable, *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
           "-m", "neuronlocal.report.child", "--report", str(out), "--state", str(state),
           "--run-id", run_id, *(["--module", module] if module else []), "--",
           *(argv[1:] if module else argv)]
    log.info("running %s with the report going to %s", target, out)
    pipes = subprocess.PIPE if pipe else None
    proc = subprocess.Popen(cmd, env=env, stdout=pipes, stderr=pipes)
    return Child(proc, out, state, time.monotonic(), created)


def finish(child: Child, status: int, quiet: bool) -> int:
    """After `child` ended with `status`: its exit status, and the report it could not
    write itself."""
    code = _finish_for_child(child.out, child.state, status, time.monotonic() - child.started,
                             quiet)
    if child.created:
        with contextlib.suppress(OSError):
            child.out.rmdir()  # only succeeds when nothing was written: leave no empty folder
    return code


def run(args: list[str], module: str | None = None, report_dir: str | Path = "neuron_report",
        quiet: bool = False) -> int:
    """Runs `script args...` (or `-m module args...`) in a child; returns its exit status.
    The job's id, which names its rank files, is derived from torchrun's environment."""
    try:
        child = start(args, module, report_dir, _run_id())
    except RunError as e:
        print(e, file=sys.stderr)
        return e.code
    previous = forwarding([child.proc])
    try:
        status = child.proc.wait()
    finally:
        restore(previous)
    return finish(child, status, quiet)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    fd = os.open(directory / ".merge.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def merge_dir(directory: Path, run_id: str | None = None) -> dict[str, Any]:
    """Merges the rank<N>.json files of one run (`run_id`; None: all) into report.json/.html."""
    ranks = []
    for p in directory.glob("rank*.json"):
        if not _RANK_FILE.fullmatch(p.name):  # a user's rankings.json is not a rank file
            continue
        with contextlib.suppress(OSError, ValueError):
            r = read_json(p)
            if isinstance(r, dict) and isinstance(r.get("run"), dict) and \
                    isinstance(r.get("rank"), int) and \
                    (run_id is None or r["run"].get("run_id") == run_id):
                ranks.append(r)
    ranks.sort(key=lambda r: r["rank"])
    rep = render.merge(ranks)
    write_private(directory / "report.json", render.to_json(rep))
    write_private(directory / "report.html", render.html_page(rep))
    return rep


def write(directory: Path, rank_report: dict[str, Any], quiet: bool = False) -> dict[str, Any]:
    """Writes this rank's JSON, re-merges the directory, prints a summary."""
    rank = rank_report["rank"]
    write_private(directory / f"rank{rank}.json", render.to_json(rank_report))
    with _locked(directory):
        rep = merge_dir(directory, rank_report["run"].get("run_id"))
    if not quiet:
        _summary(directory, rank, rep)
    return rep


def _summary(directory: Path, rank: int, rep: dict[str, Any]) -> None:
    """Prints the summary of the report just written. It never raises: the report is on
    disk, and the exit status stays the script's (a closed stderr, a rendering bug)."""
    try:
        if rep["complete"]:
            render.terminal(rep)
            print(f"neuronlocal: report written to {directory}/report.html and report.json",
                  file=sys.stderr)
        else:
            print(f"neuronlocal: rank {rank} report written to {directory}/rank{rank}.json "
                  f"({len(rep['ranks'])}/{rep['world_size']} ranks so far)", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - see the docstring
        with contextlib.suppress(Exception):
            print(f"neuronlocal: could not print the summary ({type(e).__name__}: {e}); the "
                  f"report is in {directory}/report.html and report.json", file=sys.stderr)
