"""Child processes that never outlive the process that started them (Linux)."""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """This process gets `signum` when its parent dies (a no-op where prctl is missing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))


def killed_with_parent() -> None:
    """A `preexec_fn`: the child is SIGKILLed when the process that started it dies."""
    die_with_parent(signal.SIGKILL)
