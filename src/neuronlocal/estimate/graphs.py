"""The estimated Trainium time of one captured FX graph, per node.

The graph runs once on fake copies of its inputs (shapes only, nothing computed) under the
op counter; an interpreter names the node each op belongs to. When the graph would be
differentiated (grad mode on, an output requires grad), its backward runs too, on fake
tensors, and is costed as one more entry. Collectives inside the graph are costed on the
links of the emulated instance. The fake run is the observer's own: the program's ambient
dispatch modes and saved-tensor hooks (activation checkpointing's) never see it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from neuronlocal.estimate.counting import Counter, Tally
from neuronlocal.estimate.rates import InstanceSpec
from neuronlocal.estimate.roofline import Factors, seconds

CALIBRATED_MIN_S = 5e-3  # the fastest published row fitted is a ~6 ms decode step


class _Named(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, counter: Counter) -> None:
        super().__init__(gm)
        self.counter = counter

    def run_node(self, n: fx.Node) -> Any:
        self.counter.key = n.name
        return super().run_node(n)


def _fake(mode: Any, x: Any) -> Any:
    """A fake leaf like `x`: the graph's backward is costed, never its input's history (a
    fake of a non-leaf input cannot be differentiated through)."""
    if not isinstance(x, torch.Tensor):
        return x
    leaf = x.detach().requires_grad_(x.requires_grad) if x.requires_grad and not x.is_leaf \
        else x
    return mode.from_tensor(leaf, static_shapes=True)


def fake_inputs(example_inputs: list[Any]) -> tuple[Any, list[Any]]:
    """A fake mode and fake copies of `example_inputs` (shapes only: cheap to keep)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # A shape environment: the fake rules of while_loop and cond need one.
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    return mode, [_fake(mode, x) for x in example_inputs]


def _same(x: Any) -> Any:
    return x


@contextmanager
def _apart() -> Iterator[None]:
    """The program's dispatch modes and saved-tensor hooks off, as AOTAutograd traces.

    A graph compiles at its first call, which may be inside a checkpointed region: its
    saved-tensor hooks would count the fake run's saved tensors as the region's (full
    checkpointing then finds a different number in the recompute) and, in the recompute,
    stop it at the fake run's first save (its `_StopRecomputationError`, swallowed by the
    estimate), so the program's backward would fail. Hooks pushed on top of the program's
    are the ones used; a checkpoint inside the graph pushes its own above these.
    """
    disabled = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    with _disable_current_modes():
        if disabled is not None:  # the program's hooks do not apply here already
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            yield


def count_graph(gm: fx.GraphModule, example_inputs: list[Any],
                fakes: tuple[Any, list[Any]] | None = None) -> tuple[Counter, bool]:
    """(counter with per-node tallies, whether a backward was counted)."""
    mode, inputs = fakes or fake_inputs(example_inputs)
    # A checkpointed region replays its forward in the backward, op for op; attention
    # replaced in one and not the other (the backward may run on another thread, outside
    # the function mode) would not replay. Its fused attention kernel is costed as one op.
    checkpointed = any(n.target is torch.ops.higher_order.tag_activation_checkpoint
                       for n in gm.graph.nodes)
    counter = Counter(replace_attention=not checkpointed)
    backward = False
    with _apart(), mode, counter:
        outs = _Named(gm, counter).run(*inputs)
        flat = [o for o in torch.utils._pytree.tree_leaves(outs)
                if isinstance(o, torch.Tensor) and o.requires_grad and o.grad_fn is not None]
        if torch.is_grad_enabled() and flat:
            counter.key = "backward"
            torch.autograd.backward(flat, [torch.ones_like(o) for o in flat])
            backward = True
    return counter, backward


def graph_cost(gm: fx.GraphModule, example_inputs: list[Any], spec: InstanceSpec,
               factors: Factors, band: float,
               fakes: tuple[Any, list[Any]] | None = None) -> dict[str, Any]:
    """Per-call cost of a graph on one logical core of `spec`, with the error band."""
    counter, backward = count_graph(gm, list(example_inputs), fakes)
    fwd = Tally()
    for key, t in counter.per_key.items():
        if key != "backward":
            fwd.merge(t)
    bwd = counter.per_key.get("backward", Tally())
    fwd_s = seconds(fwd, spec, factors) + factors.launch
    bwd_s = seconds(bwd, spec, factors) + factors.launch if backward else 0.0
    total = fwd_s + bwd_s
    nodes = sorted(((k, seconds(t, spec, factors), t.tensor_flops)
                    for k, t in counter.per_key.items() if k != "backward"),
                   key=lambda x: -x[1])[:5]
    return {
        "instance": spec.name, "lnc": spec.lnc,
        "tensor_flops": fwd.tensor_flops, "backward_tensor_flops": bwd.tensor_flops,
        "hbm_bytes": fwd.total("bytes") + bwd.total("bytes"),
        "comm_bytes": fwd.total("comm_bytes") + bwd.total("comm_bytes"),
        "seconds": fwd_s, "backward_seconds": bwd_s,
        "band": [total / (1 + band), total * (1 + band)],
        "calibrated": total >= CALIBRATED_MIN_S,
        "top_nodes": [{"node": k, "seconds": s, "tensor_flops": f} for k, s, f in nodes],
        # Higher-order operators run without their cost (the estimate is a lower bound).
        "uncounted": sorted(counter.uncounted),
    }
