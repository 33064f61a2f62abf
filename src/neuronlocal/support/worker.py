"""One row of the support matrix, computed in a process of its own.

The matrix forks each row from a forkserver that imported this module once (and with it
torch, transformers and neuronlocal), so a row costs its own work, not the imports, and a
crash, hang or memory blow-up loses that row only. By hand:
`python -m neuronlocal.support.worker MODEL_TYPE ARCH TASK` prints the row as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - imported once in the forkserver, not per row
import torch._inductor.compile_fx  # noqa: F401
import transformers
from transformers.models.auto import modeling_auto  # noqa: F401

from neuronlocal.support import configs, models, tiny  # noqa: F401


def _quiet() -> None:
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    # One compile thread: rows already run in parallel, and a compile pool per row costs
    # more to start than it saves on tiny graphs.
    torch._inductor.config.compile_threads = 1


def row(model_type: str, arch: str, task: str,
        progress: Callable[[models.ModelReport], None] | None = None) -> dict[str, Any]:
    _quiet()
    rep = models.check_model(model_type, arch, modes=models.TASK_MODES[task], task=task,
                             progress=progress)
    return rep.as_dict()


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(path)


def run_to_file(model_type: str, arch: str, task: str, result: str, log: str,
                env: dict[str, str] | None = None) -> None:
    """Forkserver entry: `env` set for this row, output to `log`, the row (JSON) to `result`,
    atomically; after each mode the row so far goes to `result.partial`, which a timed-out
    row keeps."""
    os.environ.update(env or {})
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    data = row(model_type, arch, task,
               progress=lambda rep: _write(result + ".partial", rep.as_dict()))
    _write(result, data)
    sys.stdout.flush()


def main() -> None:
    model_type, arch, task = sys.argv[1:4]
    print(json.dumps(row(model_type, arch, task), default=str), flush=True)


if __name__ == "__main__":
    main()
