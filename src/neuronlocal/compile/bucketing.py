"""Bucketing: pad a batch to one of a few sequence lengths so shapes, and compiles, repeat.

Trainium compiles each new shape; the documented answer to varying sequence
lengths is padding to buckets. `pad_to_bucket` pads the last dimension of `input_ids` to
the smallest bucket that fits and returns the matching attention mask.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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


def suggest_buckets(lengths: Iterable[int], max_buckets: int = 4) -> list[int]:
    """A small bucket set covering the lengths seen: quantiles rounded up to multiples of 8."""
    seen = sorted(set(lengths))
    if not seen:
        return []
    if len(seen) <= max_buckets:
        return sorted({((x + 7) // 8) * 8 for x in seen})
    picks = []
    for k in range(1, max_buckets + 1):
        x = seen[min(len(seen) - 1, round(k * len(seen) / max_buckets) - 1)]
        picks.append(((x + 7) // 8) * 8)
    picks[-1] = max(picks[-1], ((seen[-1] + 7) // 8) * 8)
    return sorted(set(picks))
