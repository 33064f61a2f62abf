"""Bucketing: pad a batch to one of a few sequence lengths so shapes, and compiles, repeat.

Trainium compiles each new shape; the documented answer to varying sequence
lengths is padding to buckets. `pad_to_bucket` pads the last dimension of `input_ids` to
the smallest bucket that fits and returns the matching attention mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch


def default_buckets(max_len: int, smallest: int = 32) -> list[int]:
    """Powers of two from `smallest` up to (and including) `max_len`."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    out.append(max_len)
    return out


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    for b in sorted(buckets):
        if length <= b:
            return b
    raise ValueError(f"sequence length {length} exceeds the largest bucket {max(buckets)}; "
                     "add a larger bucket or truncate the input.")


def pad_to_bucket(input_ids: torch.Tensor, buckets: Sequence[int], pad_id: int = 0,
                  attention_mask: torch.Tensor | None = None, side: str = "right"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded input_ids, attention_mask) with the last dim padded to its bucket."""
    length = input_ids.shape[-1]
    target = bucket_for(length, buckets)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.long)
    pad = target - length
    if pad == 0:
        return input_ids, attention_mask
    spec = (0, pad) if side == "right" else (pad, 0)
    ids = torch.nn.functional.pad(input_ids, spec, value=pad_id)
    mask = torch.nn.functional.pad(attention_mask, spec, value=0)
    return ids, mask


def fit_buckets(lengths: Iterable[int] | Mapping[int, float], max_buckets: int = 4,
                step: int = 8, cost: Callable[[int], float] | None = None,
                largest: int | None = None) -> list[int]:
    """The bucket set (multiples of `step`, at most `max_buckets`) that minimises the summed
    `cost(bucket)` over `lengths`, each length padded to its bucket and counted as often as it
    occurs (or by its weight, when `lengths` maps length -> weight). `cost` must not decrease
    with the bucket (default: the bucket itself, i.e. padded tokens). `largest` forces the
    top bucket (it must cover every length). Of equally cheap sets the fewest buckets win.

    Exact: an optimal bucket always sits on a length rounded up to `step` (lowering it to the
    largest length it serves never costs more), so a dynamic programme over those values
    finds the optimum in O(max_buckets * n**2) for n distinct rounded lengths."""
    import numpy as np

    counts: dict[int, float] = {}
    pairs = lengths.items() if isinstance(lengths, Mapping) else ((x, 1.0) for x in lengths)
    for x, w in pairs:
        r = max(step, -(-int(x) // step) * step)
        counts[r] = counts.get(r, 0.0) + w
    if not counts:
        return []
    if largest is not None:
        if largest < max(counts):
            raise ValueError(f"largest bucket {largest} is below the longest length "
                             f"{max(counts)}")
        counts.setdefault(largest, 0)
    values = sorted(counts)
    if max_buckets < 1:
        raise ValueError("max_buckets must be at least 1")
    price = np.array([float(cost(v)) if cost else float(v) for v in values])
    cum = np.concatenate([[0.0], np.cumsum([counts[v] for v in values], dtype=float)])
    n = len(values)
    # best[k][j]: cheapest cover of values[:j + 1] with k + 1 buckets, the top one values[j]
    best = [price * cum[1:]]
    back: list[np.ndarray] = []
    for _ in range(1, min(max_buckets, n)):
        prev, row, arg = best[-1], np.full(n, np.inf), np.zeros(n, dtype=int)
        for j in range(1, n):
            cand = prev[:j] + price[j] * (cum[j + 1] - cum[1:j + 1])
            i = int(np.argmin(cand))
            row[j], arg[j] = cand[i], i
        best.append(row)
        back.append(arg)
    totals = [row[n - 1] for row in best]
    floor = min(totals)
    k = next(k for k, t in enumerate(totals) if t <= floor * (1 + 1e-12))
    out, j = [values[n - 1]], n - 1
    for level in range(k, 0, -1):
        j = int(back[level - 1][j])
        out.append(values[j])
    return sorted(out)


def suggest_buckets(lengths: Iterable[int], max_buckets: int = 4) -> list[int]:
    """The fewest buckets (multiples of 8, at most `max_buckets`) that pad `lengths` least:
    `fit_buckets` with padded tokens as the cost (the run report's suggestion)."""
    return fit_buckets(lengths, max_buckets)
