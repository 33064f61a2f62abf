"""One row of the support matrix, computed in a process of its own.

The matrix forks each row from a forkserver that imported this module once (and with it
torch, transformers and neuronlocal) and warmed Inductor (`warm`, run by support/preload.py),
so a row costs its own work, not the imports or the compiler's first use, and a crash, hang
or memory blow-up loses that row only. By hand:
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


def warm() -> None:
    """Pays Inductor's first-use cost (CPU ISA probes, pattern-matcher setup, lazy imports)
    once, at the rows' settings, in the forkserver, so rows forked from it start warm.

    Inference only, on one thread: anything that runs autograd (a backward, or AOTAutograd
    tracing a joint graph) starts autograd's device threads, which a forked child cannot
    use, and one thread means no OpenMP team exists at the fork. A failure here is left for
    the rows to meet and report."""
    from neuronlocal.support.matrix import worker_env

    os.environ.update(worker_env())  # the forkserver's own environment, not the caller's
    _quiet()
    torch.set_num_threads(1)
    try:
        lin = torch.nn.Linear(4, 4).to("neuron")
        step = torch.compile(lambda t: torch.nn.functional.gelu(lin(t)).softmax(-1).sum(),
                             backend="neuron")
        with torch.no_grad():
            step(torch.ones(2, 4).to("neuron"))
    except Exception:  # noqa: BLE001, S110 - each row compiles again and reports its own error
        pass
    finally:
        torch._dynamo.reset()


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
                env: dict[str, str] | None = None, threads: int = 1) -> None:
    """Forkserver entry: `env` and `threads` (intra-op threads; rows run side by side) set for
    this row, output to `log`, the row (JSON) to `result`, atomically; after each mode the
    row so far goes to `result.partial`, which a timed-out row keeps."""
    os.environ.update(env or {})
    torch.set_num_threads(threads)
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
