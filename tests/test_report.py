"""`neuronlocal run` reports: recompiles and buckets, fallbacks with call sites, OOM, ranks,
the profiler trace, the metrics API and TORCH_NEURONX_LOG_LEVEL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from neuronlocal.report import analysis, metrics, render

pytestmark = pytest.mark.timeout(600)

SEQ_SCRIPT = """\
import sys
import torch
from neuronlocal.compile.bucketing import pad_to_bucket

buckets = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else None
emb = torch.nn.Embedding(50, 4).to("neuron")

def step(ids):
    return emb(ids).sum(1)

f = torch.compile(step, backend="neuron")
for length in [5, 6, 7, 9, 10, 12]:
    ids = torch.randint(0, 50, (2, length)).to("neuron")
    if buckets:
        ids, _ = pad_to_bucket(ids, buckets)
    f(ids)
a = torch.ones(3, 3, device="neuron") + torch.eye(3, device="neuron")
torch.linalg.inv(a)  # FALLBACK-LINE
"""


def run_cli(tmp_path: Path, args: list[str], env: dict[str, str] | None = None,
            launcher: list[str] | None = None, timeout: int = 300
            ) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "report"
    full_env = {**os.environ, "TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff"),
                "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "locks"), **(env or {})}
    cmd = (launcher or [sys.executable]) + ["-m", "neuronlocal", "run", "--report", str(out),
                                            *args]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)
    return proc, out


def script(tmp_path: Path, name: str, code: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(code))
    return p


def test_recompiles_reason_buckets_and_fallback_site(tmp_path):
    path = script(tmp_path, "seq.py", SEQ_SCRIPT)
    proc, out = run_cli(tmp_path, [str(path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["complete"] and len(rep["ranks"]) == 1
    r = rep["ranks"][0]
    lengths = [5, 6, 7, 9, 10, 12]
    assert len(r["graphs"]) == len(lengths)
    rec = r["recompiles"]
    assert len(rec) == len(lengths) - 1
    # The first recompile is Dynamo's: its failed guard names the tensor and the size.
    assert "tensor 'ids' size mismatch at index 1. expected 5, actual 6" in rec[0]["reason"]
    for e, (old, new) in zip(rec, zip(lengths, lengths[1:], strict=False), strict=True):
        assert e["changed"] == [{"input": 1, "dim": 1, "before": old, "after": new}]
        assert "step" in e["function"]
    (b,) = r["bucket_suggestions"]
    assert (b["input"], b["dim"], b["name"], b["sizes"]) == (1, 1, "ids", lengths)
    assert b["graphs_with_buckets"] < len(lengths)
    # The fallback op is reported with the user's line.
    inv = next(f for f in r["fallback_ops"] if f["op"] == "aten::linalg_inv_ex.inverse")
    line = SEQ_SCRIPT.splitlines().index("torch.linalg.inv(a)  # FALLBACK-LINE") + 1
    assert (Path(inv["file"]).name, inv["line"], inv["count"]) == ("seq.py", line, 1)
    assert "FALLBACK-LINE" in inv["source"]
    # What the fallback costs: the 3x3 float32 input to the host; inverse and info back.
    assert (inv["to_host_bytes"], inv["from_host_bytes"]) == (36, 36 + 4)
    assert "Recompilations" in proc.stderr and "seq.py:" in proc.stderr
    page = (out / "report.html").read_text()
    assert "<svg" in page and "<script" not in page and "size mismatch" in page

    # Applying the suggestion: one graph per bucket, so only the bucket warm-ups recompile.
    proc, out = run_cli(tmp_path, [str(path), ",".join(map(str, b["buckets"]))])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r2 = json.loads((out / "report.json").read_text())["ranks"][0]
    assert len(r2["graphs"]) == len(b["buckets"])
    assert len(r2["recompiles"]) == len(b["buckets"]) - 1 < len(rec)
    assert {s[1][1] for g in r2["graphs"] for s in [g["input_shapes"]]} == set(b["buckets"])
    assert r2["bucket_suggestions"] == []


def test_oom_script_still_reports_peak_and_core(tmp_path):
    path = script(tmp_path, "oom.py", """\
        import torch
        keep = []
        while True:
            keep.append(torch.empty(8 * 2**20, dtype=torch.uint8, device="neuron:1"))
        """)
    proc, out = run_cli(tmp_path, [str(path)], env={"NEURONLOCAL_HBM_PER_CORE": "64MiB"})
    assert proc.returncode == 1
    assert "OutOfMemoryError" in proc.stderr
    r = json.loads((out / "report.json").read_text())["ranks"][0]
    assert r["run"]["exit_code"] == 1 and r["run"]["error"]["type"] == "OutOfMemoryError"
    assert "neuron:1" in r["run"]["error"]["message"] or "1" in r["run"]["error"]["message"]
    (core,) = [m for m in r["memory"] if m["core"] == 1]
    assert core["hbm_bytes"] == 64 * 2**20 and core["num_ooms"] >= 1
    assert 56 * 2**20 <= core["peak_bytes"] <= 64 * 2**20
    assert max(b for _, b in core["timeline"]) == core["peak_bytes"]
    assert "neuron:1" in (out / "report.html").read_text()


def test_module_mode_and_exit_status(tmp_path):
    (tmp_path / "mymod.py").write_text("import sys, torch\n"
                                       "torch.ones(2, device='neuron').sum()\n"
                                       "sys.exit(int(sys.argv[1]))\n")
    proc, out = run_cli(tmp_path, ["-m", "mymod", "3"], env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 3, proc.stderr[-2000:]
    r = json.loads((out / "report.json").read_text())["ranks"][0]
    assert r["run"]["argv"] == ["mymod", "3"]
    assert any(k.startswith("aten::sum") for k in r["eager_ops"])


def test_torchrun_one_report_per_rank_merged(tmp_path):
    path = script(tmp_path, "ranks.py", """\
        import torch
        import torch.distributed as dist
        from neuronlocal.report import record_collective
        dist.init_process_group("neuron")
        x = torch.ones(1024, device="neuron")  # 4 KiB
        dist.all_reduce(x)
        dist.all_reduce(x)
        if dist.get_rank() == 1:
            record_collective("custom_send", 100)  # the API code can call itself
        dist.destroy_process_group()
        """)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone"]
    proc, out = run_cli(tmp_path, [str(path)], launcher=torchrun, timeout=180,
                        env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    rep = json.loads((out / "report.json").read_text())
    assert rep["complete"] and [r["rank"] for r in rep["ranks"]] == [0, 1]
    coll = {r["rank"]: {c["op"]: (c["count"], c["bytes"]) for c in r["collectives"]}
            for r in rep["ranks"]}
    assert coll[0]["all_reduce"] == coll[1]["all_reduce"] == (2, 8192)
    assert "custom_send" not in coll[0] and coll[1]["custom_send"] == (1, 100)
    assert "rank 1 all_reduce" in (out / "report.html").read_text()


def test_profiler_trace_has_neuron_ops_and_compiled_graphs(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    f = torch.compile(lambda x: (x * 2).sum(), backend="neuron")
    x = torch.ones(4, device="neuron")
    f(x)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        f(x)
        torch.mm(x.view(2, 2), x.view(2, 2))
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "aten::mm" in names
    assert any(n and n.startswith("neuron_graph::") for n in names)
    torch._dynamo.reset()


def test_metrics_api_counters_and_report():
    metrics.reset()
    metrics.record_collective("all_gather", 4096, rank=0)
    metrics.record_collective("all_gather", 4096, rank=0)
    metrics.increment("steps", 3)
    torch.ones(3, device="neuron").add_(1)
    c = metrics.counters()
    assert c["collectives"] == 2 and c["collective_bytes"] == 8192 and c["steps"] == 3
    assert c["eager_ops"] >= 1
    text = metrics.report()
    assert "all_gather" in text and "Collectives" in text
    metrics.reset()


def test_log_level_enables_debug_logs(fresh_python):
    r = fresh_python("""\
        import torch
        from neuronlocal.report import record_collective
        record_collective("broadcast", 16)
        """, env={"TORCH_NEURONX_LOG_LEVEL": "3"})
    assert r.returncode == 0, r.stderr
    assert "[neuronlocal DEBUG neuronlocal.report] collective broadcast: 16 bytes" in r.stderr


def test_duplicate_shape_and_already_bucketed_analysis():
    def g(i, shapes, cid):
        return {"graph_id": i, "graph_name": f"graph_{i}", "input_shapes": shapes,
                "input_dtypes": ["torch.float32"], "kind": "static", "cache": "miss",
                "compile_seconds": 0.1, "extra": {"compile_id": cid}}

    graphs = [g(0, [(2, 8)], "0/0"), g(1, [(2, 16)], "0/1"), g(2, [(2, 8)], "0/1")]
    res = analysis.recompiles(graphs, [], {})
    assert [e["graph"] for e in res["recompiles"]] == ["graph_1", "graph_2"]
    assert res["recompiles"][1]["reason"].startswith("same shapes as graph_0")
    assert res["buckets"] == []  # 8 and 16 are already the buckets one would suggest


def test_html_charts_are_inline_svg():
    svg = render.line_chart([("neuron:0", [[0.1, 100], [0.2, 50]])], "t", limit=200)
    assert svg.startswith("<svg") and "HBM" in svg
    assert render.bar_chart([("g", 1.0, "#000")], "b").count("<rect") == 1
