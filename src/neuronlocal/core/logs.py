"""TORCH_NEURONX_LOG_LEVEL: debug logging of the backend on stderr (TorchNeuron's variable).

0 (default) leaves Python's logging alone; 1 shows warnings, 2 info, 3 debug (every
compile with its code, every collective, the run report's steps) of the `neuronlocal`
loggers.
"""

from __future__ import annotations

import logging
import sys

_LEVELS = {1: logging.WARNING, 2: logging.INFO, 3: logging.DEBUG}


def configure(level: int) -> None:
    if level <= 0:
        return
    logger = logging.getLogger("neuronlocal")
    logger.setLevel(_LEVELS.get(min(level, 3), logging.DEBUG))
    if not any(getattr(h, "_neuronlocal", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[neuronlocal %(levelname)s %(name)s] %(message)s"))
        handler._neuronlocal = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
