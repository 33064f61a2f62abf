"""The benchmark harness every bench script uses: two sides, each in its own process.

A case times one callable on two sides (CPU and neuron, or plain and kernelized, ...).
Each side runs in a fresh process, as users run their programs, so one side's allocator
state, thread pools and caches never touch the other's. The processes alternate (a, b,
then b, a, ...) for at least `--rounds` rounds, so load on a shared machine hits both sides
alike; inside a process the callable runs `--warmup` times, then `--repeat` timed times, and
the process reports its best time. A side's number is the median over rounds, its spread the
min-max range over rounds in percent of the median, and the ratio is taken per round
(b / a, paired in time) and reported as the median ratio with its interquartile range and
its min-max range. More rounds never narrow a min-max range, so the stopping rule uses the
interquartile range: rounds are added until it is within `--target` percent of the median
(or `--max-rounds` is reached), and the table says how many rounds a case took.

Script API (bench/compile.py can use the same):

    CASES = [Case("tiny Llama train step", train_setup, {"hidden": 256}, Goal("<=", 1.15))]
    def train_setup(side: str, hidden: int) -> Callable[[], object]: ...  # built per process
    if __name__ == "__main__":
        run_cases(__file__, CASES, title="eager")

`run_cases` handles the command line (`--rounds --repeat --warmup --threads --clock --only
--out --quick`), the worker processes, the terminal table, and JSON plus HTML (with a
chart) under `--out` (default reports/bench/). Numbers taken on a loaded machine are
indicative only; `--clock cpu --threads 1` times process CPU time instead of wall time,
which load disturbs far less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_MARK = "BENCH_RESULT "


@dataclass(frozen=True)
class Goal:
    """`op` is '<=' (b/a time ratio at most `value`) or '>=' (speed-up a/b at least `value`)."""
    op: str
    value: float

    def met(self, ratio: float) -> bool:
        return ratio <= self.value if self.op == "<=" else ratio >= self.value

    def __str__(self) -> str:
        return f"{self.op}{self.value:g}"


@dataclass
class Case:
    """One comparison. `setup(side, **params)` runs in the worker process and returns the
    callable to time. With `speedup`, the ratio is a/b (higher is better), else b/a.
    `per_call` scales the reported rate (e.g. tokens per call, reported per second).
    `repeat`/`warmup` override the command line for this case (a first call is timed with
    repeat=1, warmup=0), and `prime` runs each side once untimed first (warms disk caches
    that later processes read). `adaptive=False` keeps a case at exactly `--rounds`
    (cases whose processes cost a minute)."""
    name: str
    setup: Callable[..., Callable[[], object]]
    params: dict[str, Any] = field(default_factory=dict)
    goal: Goal | None = None
    sides: tuple[str, str] = ("cpu", "neuron")
    speedup: bool = False
    per_call: float | None = None
    rate_unit: str = "per s"
    repeat: int | None = None
    warmup: int | None = None
    prime: bool = False
    adaptive: bool = True


@dataclass
class Stat:
    median: float
    low: float
    high: float
    q1: float = 0.0
    q3: float = 0.0
    n: int = 0

    @property
    def spread(self) -> float:
        """Min-max range in percent of the median."""
        return 100.0 * (self.high - self.low) / self.median if self.median else 0.0

    @property
    def iqr(self) -> float:
        """Interquartile range in percent of the median."""
        return 100.0 * (self.q3 - self.q1) / self.median if self.median else 0.0

    @staticmethod
    def of(xs: Sequence[float]) -> Stat:
        q1, q3 = (statistics.quantiles(xs, n=4, method="inclusive")[::2] if len(xs) > 1
                  else (xs[0], xs[0]))
        return Stat(statistics.median(xs), min(xs), max(xs), q1, q3, len(xs))


@dataclass
class Result:
    case: str
    sides: tuple[str, str]
    a: Stat  # seconds per call (best of a process), over rounds
    b: Stat
    ratio: Stat
    goal: str | None
    met: bool | None
    rate: tuple[float, float] | None  # per second, when the case counts items per call
    rate_unit: str = "per s"


# ---- worker side -------------------------------------------------------------------------


def _clock(kind: str) -> Callable[[], float]:
    return time.process_time if kind == "cpu" else time.perf_counter


def time_calls(fn: Callable[[], object], repeat: int, warmup: int,
               clock: str = "wall") -> list[float]:
    """Seconds of each of `repeat` calls after `warmup` calls (in this process)."""
    now = _clock(clock)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = now()
        fn()
        times.append(now() - t)
    return times


def best_of(fn: Callable[[], object], repeat: int = 5, warmup: int = 2) -> float:
    """Best wall time of `repeat` calls in this process (for checks inside one process)."""
    return min(time_calls(fn, repeat, warmup))


def _worker(cases: Sequence[Case], args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    case = next(c for c in cases if c.name == args.case)
    fn = case.setup(args.side, **case.params)
    times = time_calls(fn, args.repeat, args.warmup, args.clock)
    print(_MARK + json.dumps({"times": times}), flush=True)


# ---- parent side -------------------------------------------------------------------------


def _spawn(script: str, case: Case, side: str, args: argparse.Namespace) -> float:
    repeat = args.repeat if case.repeat is None else case.repeat
    warmup = args.warmup if case.warmup is None else case.warmup
    cmd = [sys.executable, script, "--worker", "--case", case.name, "--side", side,
           "--repeat", str(repeat), "--warmup", str(warmup), "--clock", args.clock,
           "--threads", str(args.threads)] + (["--quick"] if args.quick else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    for line in p.stdout.splitlines():
        if line.startswith(_MARK):
            return min(json.loads(line[len(_MARK):])["times"])
    raise RuntimeError(f"{case.name} [{side}] failed (exit {p.returncode}):\n"
                       f"{p.stderr[-3000:]}")


def measure(script: str, case: Case, args: argparse.Namespace,
            progress: Callable[[int], None] = lambda n: None) -> Result:
    """Runs the case's two sides in alternating fresh processes: `args.rounds` rounds, then
    (adaptive cases) more, two at a time so both orders stay balanced, until the ratio's
    interquartile range is within `args.target` percent or `args.max_rounds` is reached."""
    a_side, b_side = case.sides
    ta: list[float] = []
    tb: list[float] = []
    if case.prime:
        for side in case.sides:
            _spawn(script, case, side, args)
    limit = max(args.max_rounds, args.rounds) if case.adaptive else args.rounds
    while len(ta) < limit:
        order = (a_side, b_side) if len(ta) % 2 == 0 else (b_side, a_side)
        got = {}
        for side in order:
            got[side] = _spawn(script, case, side, args)
            progress(1)
        ta.append(got[a_side])
        tb.append(got[b_side])
        settled = len(ta) >= args.rounds and len(ta) % 2 == 0
        if settled and summarize(case, ta, tb).ratio.iqr <= args.target:
            break
    return summarize(case, ta, tb)


def summarize(case: Case, ta: Sequence[float], tb: Sequence[float]) -> Result:
    """Medians, spreads and the per-round ratio of paired times (seconds per call)."""
    ratio = Stat.of([a / b if case.speedup else b / a for a, b in zip(ta, tb, strict=True)])
    rate = None
    if case.per_call:
        rate = (case.per_call / statistics.median(ta), case.per_call / statistics.median(tb))
    return Result(case.name, case.sides, Stat.of(ta), Stat.of(tb), ratio,
                  str(case.goal) if case.goal else None,
                  case.goal.met(ratio.median) if case.goal else None, rate, case.rate_unit)


def table(results: Sequence[Result], title: str) -> None:
    """The terminal table (rich)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ("case", "a", "a ms (spread)", "b", "b ms (spread)", "ratio (IQR; range)",
                "rounds", "goal"):
        t.add_column(col, justify="left" if col in ("case", "a", "b") else "right")
    for r in results:
        mark = "" if r.met is None else (" ok" if r.met else " MISSED")
        extra = ""
        if r.rate:
            extra = f"\n{r.rate[0]:.3g} / {r.rate[1]:.3g} {r.rate_unit}"
        t.add_row(r.case + extra, r.sides[0], f"{r.a.median * 1e3:.2f} ({r.a.spread:.0f}%)",
                  r.sides[1], f"{r.b.median * 1e3:.2f} ({r.b.spread:.0f}%)",
                  f"{r.ratio.median:.3f} ({r.ratio.iqr:.0f}%; {r.ratio.low:.2f}-"
                  f"{r.ratio.high:.2f})", str(r.ratio.n), (r.goal or "-") + mark)
    Console().print(t)


def write_reports(results: Sequence[Result], name: str, title: str, out: Path,
                  meta: dict[str, Any]) -> tuple[Path, Path]:
    """JSON and a static HTML page with a ratio chart under `out`."""
    from neuronlocal.report.render import bar_chart

    out.mkdir(parents=True, exist_ok=True)
    data = {"title": title, "meta": meta, "results": [asdict(r) for r in results]}
    jpath, hpath = out / f"{name}.json", out / f"{name}.html"
    jpath.write_text(json.dumps(data, indent=2))
    bars = [(r.case, r.ratio.median, "#2ca02c" if r.met in (None, True) else "#d62728")
            for r in results]
    rows = "".join(
        f"<tr><td>{r.case}</td><td>{r.sides[0]}: {r.a.median * 1e3:.2f} ms "
        f"({r.a.spread:.0f}%)</td><td>{r.sides[1]}: {r.b.median * 1e3:.2f} ms "
        f"({r.b.spread:.0f}%)</td><td>{r.ratio.median:.3f} (IQR {r.ratio.iqr:.0f}%; "
        f"{r.ratio.low:.2f}-{r.ratio.high:.2f})</td><td>{r.ratio.n}</td>"
        f"<td>{r.goal or '-'}</td></tr>" for r in results)
    hpath.write_text(
        f"<!doctype html><meta charset='utf-8'><title>{title}</title>"
        "<style>body{font:14px system-ui,sans-serif;margin:24px}table{border-collapse:"
        "collapse}td,th{border:1px solid #ddd;padding:3px 8px}.ax{font-size:11px;fill:#555}"
        ".ct{font-size:13px;font-weight:600}</style>"
        f"<h1>{title}</h1><p>{json.dumps(meta)}</p>"
        + bar_chart(bars, "ratio per case (median over rounds)", unit="x")
        + "<table><tr><th>case</th><th>a</th><th>b</th><th>ratio (IQR; range)</th>"
        "<th>rounds</th><th>goal</th>"
        f"</tr>{rows}</table>")
    return jpath, hpath


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7,
                   help="processes per side at least (alternated)")
    p.add_argument("--max-rounds", type=int, default=15,
                   help="processes per side at most, while the ratio's IQR is over --target")
    p.add_argument("--target", type=float, default=10.0,
                   help="stop adding rounds once the ratio's IQR is within this percent")
    p.add_argument("--repeat", type=int, default=10, help="timed calls per process")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per process first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or process CPU time (steadier on a loaded machine)")
    p.add_argument("--only", action="append", default=[], help="run cases containing this")
    p.add_argument("--quick", action="store_true", help="small sizes (the script decides)")
    p.add_argument("--out", type=Path, default=Path("reports/bench"),
                   help="folder for the JSON and HTML reports")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    return p


def run_cases(script: str, cases: Sequence[Case] | Callable[[bool], Sequence[Case]],
              title: str, description: str = "", argv: Sequence[str] | None = None,
              extra: Callable[[argparse.Namespace], dict[str, Any]] | None = None
              ) -> list[Result]:
    """Command-line entry of a bench script: workers time, the parent alternates and reports.

    `cases` may be a function of `--quick`. `extra(args)` runs in the parent after the
    timings (one-process checks, e.g. outputs equal) and its dict joins the report.
    """
    args = parser(description).parse_args(argv)
    chosen = cases(args.quick) if callable(cases) else cases
    if args.worker:
        _worker(chosen, args)
        return []
    if args.only:
        chosen = [c for c in chosen if any(o in c.name for o in args.only)]
    from tqdm import tqdm

    results = []
    with tqdm(total=2 * args.rounds * len(chosen), desc=title, unit="proc") as bar:
        def step(n: int) -> None:
            bar.total = max(bar.total, bar.n + n)  # an adaptive case added rounds
            bar.update(n)
        for case in chosen:
            results.append(measure(script, case, args, step))
    table(results, f"{title}: b / a per round, median over >= {args.rounds} rounds "
                   f"(best of {args.repeat} per process, {args.clock} clock)")
    meta: dict[str, Any] = {"rounds": args.rounds, "max_rounds": args.max_rounds,
                            "target_iqr_percent": args.target, "repeat": args.repeat,
                            "warmup": args.warmup, "clock": args.clock,
                            "threads": args.threads or "default", "quick": args.quick,
                            "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}
    if extra:
        meta.update(extra(args))
    name = Path(script).stem + ("-quick" if args.quick else "")
    j, h = write_reports(results, name, title, args.out, meta)
    print(f"reports: {j} {h}")
    return results


# ---- models ------------------------------------------------------------------------------


def llama(hidden: int, layers: int, seed: int = 0) -> Any:
    """A randomly initialised HF Llama (no download): vocab 1000, MLP 2x hidden."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 4),
                      num_key_value_heads=max(hidden // 128, 2), max_position_embeddings=512)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()
