"""The benchmark harness (bench/_common.py): its statistics and its stopping rule."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _common  # noqa: E402


def test_stat_quartiles_and_ranges() -> None:
    s = _common.Stat.of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s.median, s.low, s.high, s.q1, s.q3, s.n) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    assert s.iqr == pytest.approx(100 * 2 / 3) and s.spread == pytest.approx(100 * 4 / 3)


def _args(**kw: object) -> argparse.Namespace:
    return _common.parser("").parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def _run(monkeypatch: pytest.MonkeyPatch, times: dict[str, list[float]],
         adaptive: bool = True, **kw: object) -> _common.Result:
    left = {side: list(ts) for side, ts in times.items()}
    monkeypatch.setattr(_common, "_spawn", lambda script, case, side, args: left[side].pop(0))
    case = _common.Case("c", lambda side: (lambda: None), adaptive=adaptive)
    return _common.measure("x.py", case, _args(**kw))


def test_steady_ratios_stop_at_the_minimum_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _run(monkeypatch, {"cpu": [1.0] * 20, "neuron": [1.02] * 20}, rounds=7)
    # 7 rounds, rounded up to an even count so both orders are balanced
    assert r.ratio.n == 8 and r.ratio.median == pytest.approx(1.02)


def test_noisy_ratios_add_rounds_until_the_iqr_settles(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    noisy = [1.0, 1.5, 0.7, 1.4, 0.8, 1.3, 0.75, 1.45] + [1.0] * 30
    r = _run(monkeypatch, {"cpu": [1.0] * 40, "neuron": noisy}, rounds=4, max_rounds=30)
    assert 4 < r.ratio.n < 30 and r.ratio.iqr <= 10
    capped = _run(monkeypatch, {"cpu": [1.0] * 40, "neuron": noisy * 2}, rounds=4,
                  max_rounds=6)
    assert capped.ratio.n == 6 and capped.ratio.iqr > 10  # capped: the table says so
    fixed = _run(monkeypatch, {"cpu": [1.0] * 40, "neuron": noisy}, adaptive=False,
                 rounds=3)
    assert fixed.ratio.n == 3


@pytest.mark.slow
def test_decode_breakdown_parts_add_up() -> None:
    """bench/generate.py's decode-step breakdown: each side's parts are positive and sum to
    its total, and the compiled side timed Dynamo's call and the graph apart."""
    import generate

    out = generate.breakdown(argparse.Namespace(quick=True))
    n, c = out["neuron"], out["cpu"]
    assert all(v > 0 for v in (*n.values(), *c.values()))
    assert n["dynamo"] + n["graph"] + n["loop"] == pytest.approx(n["total"], abs=0.01)
    assert c["forward"] + c["loop"] == pytest.approx(c["total"], abs=0.01)
