"""Request traces: JSONL or CSV rows of `prompt_tokens`, `output_tokens` and an optional
`arrival_s`, or the sequence lengths a `neuronlocal run` report saw.

Reads are bounded (MAX_BYTES, MAX_REQUESTS); every problem is a `TraceError` whose message
names the file, the line, the problem and the fix (the CLI prints it and exits 2).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuronlocal.core.files import check_depth, load_json, read_input

MAX_BYTES = 64 * 2**20
MAX_REQUESTS = 200_000
MAX_TOKENS = 10**7  # per request: far past any model's positions
MAX_ARRIVAL_S = 10**7  # about 116 days of traffic
COLUMNS = ("prompt_tokens", "output_tokens")


class TraceError(ValueError):
    """A trace that cannot be used (the CLI's exit status 2)."""


@dataclass(frozen=True)
class Request:
    prompt: int
    output: int
    arrival: float = 0.0


@dataclass
class Trace:
    requests: list[Request]
    source: str  # "jsonl", "csv" or "run report"
    note: str = ""  # what the trace does not say (a run report has no output lengths)


def _number(value: Any, column: str, where: str, integer: bool) -> float:
    limit = MAX_TOKENS if integer else MAX_ARRIVAL_S
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TraceError(f"{where}: {column} is a {type(value).__name__}, not a number; write "
                         "a number")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {column} is {str(value)[:40]!r}, not a number; write a "
                         "number") from None
    if not math.isfinite(x) or x > limit:
        raise TraceError(f"{where}: {column} is {str(value)[:40]!r}; write a finite number "
                         f"up to {limit:g}")
    if x < 0:
        raise TraceError(f"{where}: {column} is {value!r}, negative; lengths and times are >= 0")
    if integer and x != int(x):
        raise TraceError(f"{where}: {column} is {value!r}, not a whole number of tokens")
    return x


def _request(row: dict[str, Any], where: str) -> Request:
    missing = [c for c in COLUMNS if row.get(c) in (None, "")]
    if missing:
        raise TraceError(f"{where}: no {' or '.join(missing)}; every request needs "
                         "prompt_tokens and output_tokens (arrival_s is optional)")
    prompt = int(_number(row["prompt_tokens"], "prompt_tokens", where, True))
    output = int(_number(row["output_tokens"], "output_tokens", where, True))
    if prompt < 1 or output < 1:
        raise TraceError(f"{where}: prompt_tokens and output_tokens must be at least 1")
    arrival = row.get("arrival_s")
    t = 0.0 if arrival in (None, "") else _number(arrival, "arrival_s", where, False)
    return Request(prompt, output, t)


def _from_report(data: dict[str, Any], name: str) -> Trace:
    """The sequence lengths of a run report, each checked as a request's prompt length."""
    sizes: list[int] = []
    wrong = TraceError(f"{name}: not a run report (ranks[].bucket_suggestions[].sizes should "
                       "list lengths); give report.json of `neuronlocal run`, or JSONL or CSV")
    ranks = data.get("ranks") or []
    if not isinstance(ranks, list):
        raise wrong
    for rank in ranks:
        suggestions = rank.get("bucket_suggestions") or [] if isinstance(rank, dict) else None
        if not isinstance(suggestions, list):
            raise wrong
        for b in suggestions:
            found = b.get("sizes", []) if isinstance(b, dict) else None
            if not isinstance(found, list):
                raise wrong
            for s in found:
                n = int(_number(s, "a size", f"{name}: bucket_suggestions", True))
                if n < 1:
                    raise TraceError(f"{name}: bucket_suggestions: a size is {s!r}; a "
                                     "sequence length is at least 1")
                sizes.append(n)
            if len(sizes) > MAX_REQUESTS:
                raise TraceError(f"{name}: more than {MAX_REQUESTS:,} sizes; give a sample")
    if not sizes:
        raise TraceError(f"{name}: the run report saw no varying input length (no bucket "
                         "suggestion); give a JSONL or CSV trace")
    reqs = [Request(s, 1) for s in sorted(set(sizes))]
    return Trace(reqs, "run report", "a run report records sequence lengths, not output "
                 "lengths: each distinct length is one request of one output token "
                 "(prefill only)")


def parse(text: str, name: str) -> Trace:
    """The trace in `text` (JSONL, CSV, or a run report's report.json)."""
    stripped = text.lstrip()
    if not stripped:
        raise TraceError(f"{name}: the trace is empty; give one request per line")
    if stripped.startswith("{"):
        try:
            whole = check_depth(load_json(stripped))
        except ValueError:
            whole = None
        if isinstance(whole, dict) and "ranks" in whole:
            return _from_report(whole, name)
        rows: list[tuple[str, Any]] = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{name}:{i}", check_depth(load_json(line), 2)))
            except ValueError as e:
                why = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                raise TraceError(f"{name}:{i}: not JSON ({why}); write one JSON object per "
                                 "line") from None
            if len(rows) > MAX_REQUESTS:
                break
        source = "jsonl"
    else:
        reader = csv.DictReader(io.StringIO(text))
        try:
            header = [h.strip() for h in reader.fieldnames or []]
        except csv.Error as e:
            raise TraceError(f"{name}:1: not a CSV header or JSON ({e}); write one JSON "
                             "object per line, or a CSV file") from None
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise TraceError(f"{name}: the CSV header has no {' or '.join(missing)} column; "
                             "the first line must name prompt_tokens,output_tokens"
                             "[,arrival_s]")
        reader.fieldnames = header
        rows = []
        try:
            for i, r in enumerate(reader, 2):
                rows.append((f"{name}:{i}", r))
                if len(rows) > MAX_REQUESTS:
                    break
        except csv.Error as e:
            raise TraceError(f"{name}:{reader.line_num}: not a CSV row ({e}); write numbers "
                             "separated by commas") from None
        source = "csv"
    if len(rows) > MAX_REQUESTS:
        raise TraceError(f"{name}: more than {MAX_REQUESTS:,} requests; give a sample of the "
                         "trace")
    reqs = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise TraceError(f"{where}: {type(row).__name__}, not an object; write "
                             '{"prompt_tokens": N, "output_tokens": M}')
        reqs.append(_request(row, where))
    if not reqs:
        raise TraceError(f"{name}: the trace has no requests; give one request per line")
    return Trace(reqs, source)


def load(path: str) -> Trace:
    """The trace in the file `path`, read up to MAX_BYTES (core.files.read_input: never a
    FIFO or a device)."""
    try:
        raw = read_input(Path(path), MAX_BYTES, "a JSONL or CSV trace (or a sample of it)")
    except ValueError as e:
        raise TraceError(f"cannot read the trace: {e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{path} is not UTF-8 text; give a JSONL or CSV file") from None
    return parse(text, path)
