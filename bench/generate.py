"""Static-cache generation, compiled, each side in its own process (see _common.py).

Prefill (generate with 1 new token) and generate (N new tokens over the whole call,
prefill included: decode-dominated), greedy, `cache_implementation="static"`. neuron is
auto-compiled by transformers (backend "neuron", dynamic=False). Sides:
- `neuron`: the default compiler, against `cpu`: plain PyTorch generating on CPU as a user
  gets it (transformers compiles nothing on CPU by default);
- `neuron-inductor` (NEURONLOCAL_COMPILER=inductor), against `cpu-inductor`: the CPU model
  compiled the same way with Inductor (CompileConfig(backend="inductor", dynamic=False),
  `_compile_all_devices`);
- `neuron-tiered` (NEURONLOCAL_COMPILER=tiered, NEURONLOCAL_TIER_SWITCH=16, so the warm-up
  generation switches every graph), against `cpu` (goal >= 1.0) and `cpu-inductor` (goal
  >= 0.95): the tiered compiler's steady decode.
Ratios are speed-ups (tokens/s neuron / tokens/s CPU); goal for generate: >= 1.0.
Afterwards, in one process: a 64-token generation after warm-up must compile no new graph,
and neuron's tokens must equal CPU's; then where a decode step's time goes on each side
(`breakdown`).
Run: python bench/generate.py [--quick] [--rounds N]   (--quick: hidden 256, 2 layers, 16 new)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import Case, Goal, llama, run_cases  # noqa: E402

BATCH, PROMPT = 1, 32


def _sizes(quick: bool) -> dict[str, int]:
    return {"hidden": 256, "layers": 2, "new": 16} if quick else \
        {"hidden": 512, "layers": 4, "new": 64}


def _model(side: str, hidden: int, layers: int) -> Any:
    import os

    if side == "neuron-inductor":
        os.environ["NEURONLOCAL_COMPILER"] = "inductor"
    if side == "neuron-tiered":
        os.environ.update({"NEURONLOCAL_COMPILER": "tiered", "NEURONLOCAL_TIER_SWITCH": "16"})
    import torch
    from transformers import CompileConfig

    model = llama(hidden, layers).to(side.split("-")[0])
    if side == "cpu-inductor":
        cc = CompileConfig(backend="inductor", dynamic=False, mode="default")
        cc._compile_all_devices = True
        model.generation_config.compile_config = cc
    ids = torch.randint(0, 1000, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    return model, ids.to(side.split("-")[0])


def generate_setup(side: str, hidden: int, layers: int, tokens: int, **_: int
                   ) -> Callable[[], object]:
    import torch

    model, ids = _model(side, hidden, layers)

    def run() -> object:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens,
                                  do_sample=False, cache_implementation="static")

    return run


def cases(quick: bool) -> list[Case]:
    s = _sizes(quick)
    shape = {"hidden": s["hidden"], "layers": s["layers"]}
    out = []
    for sides, how in ((("cpu", "neuron"), "default compiler / CPU"),
                       (("cpu-inductor", "neuron-inductor"), "Inductor / stock Inductor")):
        out += [
            Case(f"prefill {BATCH}x{PROMPT} (tokens/s), {how}", generate_setup,
                 {**shape, "tokens": 1}, None, sides=sides, speedup=True,
                 per_call=BATCH * PROMPT, prime=True),
            Case(f"generate {s['new']} tokens (tokens/s), {how}", generate_setup,
                 {**shape, "tokens": s["new"]}, Goal(">=", 1.0), sides=sides, speedup=True,
                 per_call=BATCH * s["new"], prime=True),
        ]
    for base, goal in (("cpu", 1.0), ("cpu-inductor", 0.95)):
        out.append(Case(f"generate {s['new']} tokens (tokens/s), tiered compiler / {base}",
                        generate_setup, {**shape, "tokens": s["new"]}, Goal(">=", goal),
                        sides=(base, "neuron-tiered"), speedup=True,
                        per_call=BATCH * s["new"], prime=True))
    return out


def check(args: Any) -> dict[str, Any]:
    """No recompilation after warm-up, and neuron's tokens equal CPU's (one process)."""
    import torch

    s = _sizes(args.quick)
    dev, dids = _model("neuron", s["hidden"], s["layers"])
    cpu, ids = _model("cpu-inductor", s["hidden"], s["layers"])

    def gen(model: Any, x: Any) -> Any:
        return model.generate(x, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                              cache_implementation="static")

    with torch.no_grad():
        gen(dev, dids)
        before = torch.neuron.get_dynamo_metrics()
        out = gen(dev, dids)
        after = torch.neuron.get_dynamo_metrics()
        ref = gen(cpu, ids)
    res = {"new_graphs_after_warmup": after["num_graphs"] - before["num_graphs"],
           "recompiles_after_warmup": len(after["recompiles"]) - len(before["recompiles"]),
           "tokens_match_cpu": bool(torch.equal(out.cpu(), ref))}
    print(f"64-token generation after warm-up: {res['new_graphs_after_warmup']} new graphs, "
          f"{res['recompiles_after_warmup']} recompiles (goal 0); tokens match CPU: "
          f"{res['tokens_match_cpu']}")
    return res


def _timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    import time

    def run(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent.append(time.perf_counter() - start)
    return run


def breakdown(args: Any) -> dict[str, Any]:
    """Where a decode step's time goes (one process, best of 5 generations): on neuron,
    Dynamo's call of the compiled model (guards, frame and wrappers), the backend's run of
    the graph, and the rest of generate()'s loop (logits processing, stopping, inputs for the
    next step); on CPU, the eager model forward and the same loop. Diagnostic: it patches a
    transformers method and the backend's entry to time them."""
    import time

    import torch

    from neuronlocal.compile import backend

    s = _sizes(args.quick)
    new = s["new"]
    out: dict[str, Any] = {}
    for side in ("cpu", "neuron"):
        model, ids = _model(side, s["hidden"], s["layers"])
        calls: list[float] = []
        graph: list[float] = []
        if side == "neuron":
            compiled_call = model.get_compiled_call
            model.get_compiled_call = lambda cfg, f=compiled_call, c=calls: _timed(f(cfg), c)
        else:
            model.forward = _timed(model.forward, calls)
        original = backend._Specializer.__call__
        backend._Specializer.__call__ = _timed(original, graph)  # type: ignore[method-assign]
        try:
            best: dict[int, tuple[float, float, float]] = {}  # (seconds, calls, graph)
            for tokens in (1, new):
                runs: list[tuple[float, float, float]] = []
                for i in range(7):
                    calls.clear()
                    graph.clear()
                    start = time.perf_counter()
                    with torch.no_grad():
                        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens,
                                       do_sample=False, cache_implementation="static")
                    if i >= 2:  # warm-up: compiles
                        runs.append((time.perf_counter() - start, sum(calls), sum(graph)))
                best[tokens] = min(runs)
        finally:
            backend._Specializer.__call__ = original  # type: ignore[method-assign]
        (prefill, p_calls, _), (total, t_calls, t_graph) = best[1], best[new]
        steps = new - 1
        step = {"total": (total - prefill) / steps,
                "loop": (total - prefill - (t_calls - p_calls)) / steps}
        if side == "neuron":
            step.update(graph=t_graph / steps, dynamo=(t_calls - t_graph) / steps)
        else:
            step["forward"] = (t_calls - p_calls) / steps
        out[side] = {k: round(v * 1e3, 3) for k, v in step.items()}
    n, c = out["neuron"], out["cpu"]
    print(f"decode step, ms: neuron {n['total']:.2f} = Dynamo's call {n['dynamo']:.2f} + "
          f"compiled graph {n['graph']:.2f} + generate loop {n['loop']:.2f}; "
          f"cpu {c['total']:.2f} = model forward {c['forward']:.2f} + generate loop "
          f"{c['loop']:.2f}")
    return out


def extra(args: Any) -> dict[str, Any]:
    return {"check": check(args), "decode_step_ms": breakdown(args)}


if __name__ == "__main__":
    run_cases(__file__, cases, title="generate (compiled, static cache): speed-up neuron / cpu",
              description=__doc__, extra=extra)
