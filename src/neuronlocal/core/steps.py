"""Training steps from optimizer hooks: one step per outermost optimizer step.

An optimizer that steps others (torchtitan's OptimizersContainer is an Optimizer whose
`step` calls each model part's) fires the global step hooks once per optimizer; a training
step is the outermost one. Each observer keeps its own `OuterSteps`, fed by its own pre and
post hooks, so the order in which observers' hooks run does not matter.
"""

from __future__ import annotations

from typing import Any


class OuterSteps:
    """The optimizers stepping now, outermost first."""

    def __init__(self) -> None:
        self._stack: list[int] = []

    def begin(self, optimizer: Any) -> bool:
        """An optimizer's step begins; True when it is the outermost (a training step)."""
        self._drop(optimizer)
        outermost = not self._stack
        self._stack.append(id(optimizer))
        return outermost

    def end(self, optimizer: Any) -> bool:
        """An optimizer's step ended; True when that ended a training step."""
        self._drop(optimizer)
        return not self._stack

    def _drop(self, optimizer: Any) -> None:
        # An optimizer already on the stack is not stepping itself again: its earlier step
        # raised (no post hook ran), so what it and the ones it called left there is dropped.
        if id(optimizer) in self._stack:
            del self._stack[self._stack.index(id(optimizer)):]
