"""The program's line behind a CPU fallback, read from the stack of the thread running it.

Eager code: the innermost frame outside Python's and installed libraries (the rule of
`core.dynamo_metrics.user_frame`). Compiled code runs FX graph modules whose generated
`forward` is no line of the program: the node being executed is found from the generated
line (the module's line map), and its `stack_trace` (Dynamo's record of the program's
lines that produced the node, kept by AOTAutograd on forward and backward nodes) gives the
site. A checkpointed region's recompute reruns the forward's own code, so its frames are
the forward's lines.
"""

from __future__ import annotations

import linecache
import os
import re
from types import FrameType
from typing import Any

from torch import fx

from neuronlocal.core.dynamo_metrics import is_library

_FILE_LINE = re.compile(r'File "(.+?)", line (\d+)')


def site(path: str, line: int) -> dict[str, Any]:
    """A site as the report keeps it: file, line and that line's source."""
    return {"file": path, "line": line, "source": linecache.getline(path, line).strip()}


def is_program(path: str) -> bool:
    """A line of the program: not Python's or a library's, nor generated or frozen code
    (`<string>` of `python -c` is the program's)."""
    return not path.startswith(("<eval_with_key>", "<frozen")) and not is_library(path)


def call_site(frame: FrameType | None) -> tuple[dict[str, Any] | None, bool]:
    """The program's line for the innermost frame of `frame` and its callers (or None), and
    whether it is the op's own line. Not when the op runs in autograd's backward below no
    program frame: its line is then the one that called backward, a site to keep only
    until the op runs where its own line is seen (the forward, a checkpoint's recompute)."""
    own = True
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<eval_with_key>"):
            found = _graph_site(frame)
            if found is not None:
                return found, own
        elif is_program(code.co_filename):
            return site(code.co_filename, frame.f_lineno), own
        elif code.co_name == "_engine_run_backward":
            own = False
        frame = frame.f_back
    return None, False


def _graph_site(frame: FrameType) -> dict[str, Any] | None:
    """The program's line of the FX node a generated graph frame is executing."""
    gm = frame.f_locals.get("self")
    lines = getattr(gm, "_lineno_map", None)
    if not isinstance(gm, fx.GraphModule) or not lines:
        return None
    index = lines.get(frame.f_lineno - frame.f_code.co_firstlineno)
    if index is None:
        return None
    nodes = list(gm.graph.nodes)
    trace = nodes[index].meta.get("stack_trace") if index < len(nodes) else None
    return stack_trace_site(trace) if isinstance(trace, str) else None


def stack_trace_site(trace: str) -> dict[str, Any] | None:
    """The innermost line of the program in a formatted stack trace (FX's `stack_trace`)."""
    for path, line in reversed(_FILE_LINE.findall(trace)):
        if not is_library(path) and os.path.exists(path):
            return site(path, int(line))
    return None
