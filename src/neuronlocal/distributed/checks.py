"""Cross-rank checks of collective inputs: mismatched shapes or dtypes become clear errors.

gloo trusts every rank to pass matching buffers: a size mismatch surfaces as an opaque
transport error and a dtype mismatch of equal item size silently mixes bytes. With
NEURONLOCAL_DIST_CHECKS=1 (or TORCH_DISTRIBUTED_DEBUG=DETAIL, PyTorch's own switch for the
same check) every collective first all-gathers a small fingerprint of its inputs and fails
on every rank, naming the ranks and what differs. It costs one tiny collective per call.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch._C import _distributed_c10d as _c10d

from neuronlocal.config import env_flag

_OPS: dict[str, int] = {}
_DTYPES: dict[torch.dtype, int] = {}
_BY_CODE: dict[int, torch.dtype] = {}
_MAX_TENSORS = 4
_MAX_DIMS = 8
_WIDTH = 3 + _MAX_TENSORS * (2 + _MAX_DIMS)


def enabled() -> bool:
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        return True
    return env_flag("NEURONLOCAL_DIST_CHECKS")


def _dtype_code(dt: torch.dtype) -> int:
    if dt not in _DTYPES:
        for i, d in enumerate(sorted((d for d in vars(torch).values()
                                      if isinstance(d, torch.dtype)), key=str)):
            _DTYPES.setdefault(d, i + 1)
            _BY_CODE.setdefault(i + 1, d)
    return _DTYPES.get(dt, 0)


def fingerprint(what: str, tensors: Sequence[Any], root: int | None) -> torch.Tensor:
    code = _OPS.setdefault(what, zlib.crc32(what.encode()))  # same on every rank
    row = [code, len(tensors), -1 if root is None else root]
    for t in list(tensors)[:_MAX_TENSORS]:
        dims = list(t.shape)[:_MAX_DIMS]
        row += [_dtype_code(t.dtype), t.dim(), *dims, *[0] * (_MAX_DIMS - len(dims))]
    row += [0] * (_WIDTH - len(row))
    return torch.tensor(row, dtype=torch.int64)


def _describe(row: list[int]) -> str:
    names = {v: k for k, v in _OPS.items()}
    parts = [f"{names.get(row[0], '?')}", f"{row[1]} tensor(s)"]
    if row[2] >= 0:
        parts.append(f"root {row[2]}")
    for i in range(min(row[1], _MAX_TENSORS)):
        base = 3 + i * (2 + _MAX_DIMS)
        dt, nd = _BY_CODE.get(row[base], "?"), row[base + 1]
        parts.append(f"{dt}{list(row[base + 2: base + 2 + min(nd, _MAX_DIMS)])}")
    return ", ".join(str(p) for p in parts)


class Checker:
    """Runs the fingerprint all-gather on the group's inner gloo backend."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg

    def check(self, what: str, tensors: Sequence[Any], root: int | None) -> None:
        mine = fingerprint(what, tensors, root)
        size = self._pg.size()
        out = torch.empty(size * _WIDTH, dtype=torch.int64)
        self._pg._gloo._allgather_base(out, mine, _c10d.AllgatherOptions()).wait()
        rows = out.view(size, _WIDTH).tolist()
        if all(r == rows[0] for r in rows):
            return
        lines = "\n".join(f"  rank {i}: {_describe(r)}" for i, r in enumerate(rows))
        raise ValueError(
            f"neuron backend: ranks called {what} with mismatched inputs (shapes, dtypes, "
            f"tensor counts, roots or collectives differ):\n{lines}\nEvery rank must pass "
            "tensors of the same shape and dtype to the same collective, in the same order.")
