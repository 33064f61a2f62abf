"""What a graph module computes, as text for its compile cache key (compile/cache.py).

A Dynamo graph calls the bodies of its higher-order ops (torch.cond branches, checkpointed
regions, FlexAttention's score_mod and mask_mod) by attribute name, so its top-level code
prints alike for graphs that differ only inside a body: the text covers every graph it
calls, recursively, with the attributes each reads and the Python functions each calls.
"""

from __future__ import annotations

import hashlib
import types
from typing import Any

# Tensor attributes up to this size are hashed by value (a compiled graph keeps its constants);
# larger ones (weights, when not lifted to inputs) by layout only.
_HASHED_CONSTANT_BYTES = 2**20


def _attribute_text(val: Any) -> str:
    """What a graph attribute contributes to its key: a tensor's layout (and the values of a
    small real one), a plain constant's repr, another object's type."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    if isinstance(val, torch.Tensor):
        meta = (f"tensor {type(val).__name__} {tuple(val.shape)} {tuple(val.stride())} "
                f"{val.dtype} {val.device.type} grad={val.requires_grad}")
        plain = type(val) in (torch.Tensor, torch.nn.Parameter) and not isinstance(val, FakeTensor)
        if not plain or val.device.type not in ("cpu", "neuron") or \
                val.numel() * val.element_size() > _HASHED_CONSTANT_BYTES:
            return meta
        from neuronlocal import _C

        with unset_fake_temporarily():
            host = val.detach()
            host = _C._cpu_alias(host) if host.device.type == "neuron" else host
            data = host.contiguous().view(-1).view(torch.uint8).numpy().tobytes() \
                if host.numel() else b""
        return f"{meta} {hashlib.sha256(data).hexdigest()}"
    if val is None or isinstance(val, (bool, int, float, complex, str, bytes)):
        return repr(val)[:4096]
    return f"object {type(val).__module__}.{type(val).__qualname__}"


def _function_text(fn: Any) -> str:
    """A Python function a graph calls (not an op): its name prints alike for two different
    functions, so its bytecode and constants name it."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return ""
    h = hashlib.sha256()

    def add(c: types.CodeType) -> None:  # nested code objects by content, not address
        h.update(c.co_code)
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                add(const)
            else:
                h.update(repr(const).encode())

    add(code)
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"
    return f"function {name} {h.hexdigest()[:16]}"


def graph_text(gm: Any) -> str:
    """Everything in a graph module that decides what it computes: its code, and the code of
    every graph it calls (the bodies of higher-order ops: torch.cond branches, checkpointed
    regions, FlexAttention's score_mod and mask_mod), recursively, with the attributes each
    reads and the Python functions each calls. Two graphs that differ only inside a body
    print the same top-level code, so hashing that alone would serve one the other's code."""
    import torch
    from torch import fx

    parts: list[str] = []
    seen: set[int] = set()

    def visit(mod: Any, path: str) -> None:
        parts.append(f"## {path} {type(mod).__qualname__}")
        if id(mod) in seen:
            parts.append("(seen)")
            return
        seen.add(id(mod))
        if not isinstance(mod, fx.GraphModule):  # a plain module a graph calls
            parts.append(repr(mod)[:4096])
            for name, t in (*mod.named_parameters(), *mod.named_buffers()):
                parts.append(f"{name}: {_attribute_text(t)}")
            return
        parts.append(mod.code)
        for node in mod.graph.nodes:
            if node.op in ("get_attr", "call_module"):
                try:
                    val = _attribute_of(mod, node.target)
                except AttributeError:
                    parts.append(f"{node.target}: missing")
                    continue
                if isinstance(val, torch.nn.Module):
                    visit(val, f"{path}.{node.target}")
                else:
                    parts.append(f"{node.target}: {_attribute_text(val)}")
            elif node.op == "call_function" and not isinstance(
                    node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                                  torch._ops.HigherOrderOperator)):
                text = _function_text(node.target)
                if text:
                    parts.append(text)

    visit(gm, "graph")
    return "\n".join(parts)


def _attribute_of(mod: Any, target: str) -> Any:
    for part in target.split("."):
        mod = getattr(mod, part)
    return mod
