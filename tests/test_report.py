"""`neuronlocal run` reports: recompiles and buckets, fallbacks with call sites, OOM, ranks,
the profiler trace, the metrics API and TORCH_NEURONX_LOG_LEVEL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

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
    inv = next(f for f in r["fallback_ops"] if f["op"] == "aten::linalg_inv_ex")
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
    assert r["run"]["error"]["message"].startswith("neuron:1 out of memory: tried to allocate")
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


# ---- every way a script can end: exit status, message, and a report ---------------------------

NEURON_WORK = "import torch\ny = (torch.ones(4, device='neuron') * 2).sum()\n"


def _report(out: Path) -> dict:
    rep = json.loads((out / "report.json").read_text())
    assert (out / "report.html").exists()
    return rep["ranks"][0]


def test_bare_assert_still_writes_report_and_summary(tmp_path):
    path = script(tmp_path, "bare.py", NEURON_WORK + "assert y.item() == 0\n")
    proc, out = run_cli(tmp_path, [str(path)])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "AssertionError" in proc.stderr and "neuronlocal run report" in proc.stderr
    r = _report(out)
    assert r["run"]["error"]["type"] == "AssertionError" and r["run"]["error"]["message"] == ""
    assert r["run"]["ended_by"] == "exception"
    assert "the script raised AssertionError" in (out / "report.html").read_text()


def test_keyboard_interrupt_exits_130_with_report(tmp_path):
    path = script(tmp_path, "kbd.py", NEURON_WORK + "raise KeyboardInterrupt\n")
    proc, out = run_cli(tmp_path, [str(path)])
    assert proc.returncode == 130, proc.stderr[-2000:]
    r = _report(out)
    assert r["run"]["exit_code"] == 130 and r["run"]["ended_by"] == "KeyboardInterrupt"


def _sigint_once_ready(tmp_path: Path, wait: str, disposition: Any) -> tuple[int, str, Path]:
    """Runs a script under `neuronlocal run` started with SIGINT set to `disposition`, sends
    SIGINT to `run` once the script is running, and returns (exit status, stderr, report
    folder). `wait` is the script's code after it says it is ready."""
    import signal
    import time

    ready = tmp_path / "ready"
    path = script(tmp_path, "wait.py", NEURON_WORK + "import pathlib, time\n"
                  f"pathlib.Path({str(ready)!r}).write_text('1')\n" + wait)
    out = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "neuronlocal", "run", "--report", str(out),
                             str(path)], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    deadline = time.time() + 120
    while not ready.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "timeout"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, out


def test_sigint_to_run_is_forwarded_and_exits_130(tmp_path):
    """SIGINT sent to `neuronlocal run` (not from a terminal) reaches the script. Started as
    from an interactive shell (SIGINT handled), even when this suite runs as a background
    job, which inherits SIGINT ignored."""
    import signal

    # Short sleeps: the kernel may deliver SIGINT to any thread, and Python runs the handler
    # only when the main thread wakes.
    code, err, out = _sigint_once_ready(
        tmp_path, "for _ in range(1200):\n    time.sleep(0.1)\n", signal.SIG_DFL)
    assert code == 130, err[-2000:]
    r = _report(out)
    assert r["run"]["ended_by"] == "KeyboardInterrupt"
    assert any(k.startswith("aten::mul") for k in r["eager_ops"])


def test_an_ignored_sigint_stays_ignored(tmp_path):
    """Started with SIGINT ignored (a background job of a script), `neuronlocal run` behaves
    as plain python would: a SIGINT changes nothing and the script ends normally."""
    import signal

    code, err, out = _sigint_once_ready(tmp_path, "time.sleep(3)\n", signal.SIG_IGN)
    assert code == 0, err[-2000:]
    assert _report(out)["run"]["error"] is None


def test_sys_exit_with_message_prints_it_and_exits_1(tmp_path):
    path = script(tmp_path, "msg.py", NEURON_WORK + "import sys\nsys.exit('bad config: x')\n")
    proc, out = run_cli(tmp_path, [str(path)])
    assert proc.returncode == 1
    assert "bad config: x" in proc.stderr.splitlines()
    r = _report(out)
    assert r["run"]["error"] == {"type": "SystemExit", "message": "bad config: x",
                                 "traceback": ""}


def test_unwritable_report_dir_fails_before_the_script_runs(tmp_path):
    marker = tmp_path / "ran"
    path = script(tmp_path, "side.py", f"open({str(marker)!r}, 'w').write('1')\n")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run([sys.executable, "-m", "neuronlocal", "run", "--report",
                           str(blocker / "report"), str(path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("neuronlocal run: cannot write the report to ")
    assert len(proc.stderr.strip().splitlines()) == 1 and not marker.exists()


def test_os_exit_writes_the_full_report(tmp_path):
    path = script(tmp_path, "oexit.py", NEURON_WORK + "import os\nos._exit(3)\n")
    proc, out = run_cli(tmp_path, [str(path)])
    assert proc.returncode == 3, proc.stderr[-2000:]
    r = _report(out)
    assert r["run"]["exit_code"] == 3 and r["run"]["ended_by"] == "os._exit"
    assert any(k.startswith("aten::mul") for k in r["eager_ops"])
    assert not list(out.glob(".state-*"))


def test_forked_children_ending_do_not_end_the_report(tmp_path):
    path = script(tmp_path, "forks.py", NEURON_WORK + """\
import os, sys
for how in ("os._exit", "sys.exit"):
    pid = os.fork()
    if pid == 0:
        os._exit(7) if how == "os._exit" else sys.exit(5)
    os.waitpid(pid, 0)
""")
    proc, out = run_cli(tmp_path, [str(path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _report(out)["run"]["ended_by"] == "return"


def test_segfault_leaves_the_last_snapshot_as_report(tmp_path):
    from neuronlocal.report.child import SNAPSHOT_SECONDS

    path = script(tmp_path, "crash.py", NEURON_WORK + f"""\
import ctypes, time
time.sleep({SNAPSHOT_SECONDS + 2})
ctypes.string_at(0)
""")
    proc, out = run_cli(tmp_path, [str(path)])
    assert proc.returncode == 128 + 11, proc.stderr[-2000:]
    r = _report(out)
    assert r["run"]["exit_code"] == 139 and r["run"]["ended_by"] == "killed by SIGSEGV"
    assert "killed by SIGSEGV" in r["run"]["error"]["message"]
    assert any(k.startswith("aten::mul") for k in r["eager_ops"])
    assert "killed by SIGSEGV" in (out / "report.html").read_text()
    assert not list(out.glob(".state-*"))


def test_a_snapshot_cut_off_by_a_crash_is_removed_but_other_runs_files_stay(tmp_path):
    # A crash while the snapshot thread writes leaves its temporary file behind; the
    # parent removes it with the state file, and leaves another run's files alone.
    from neuronlocal.report import child, runner

    state = tmp_path / ".state-mine.json"
    child.write_state(state, {"status": "running", "report": None})
    cut_off = tmp_path / f"{state.name}.x1y2.tmp"
    cut_off.write_text('{"status": "runn')
    other = tmp_path / ".state-other.json.a1b2.tmp"
    other.write_text("{}")
    assert runner._finish_for_child(tmp_path, state, -11, 1.0, quiet=True) == 139
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]


@pytest.mark.parametrize(("args", "code", "message"), [
    (["missing.py"], 2, "neuronlocal run: can't open file '{tmp}/missing.py': [Errno 2] No such "
                        "file or directory"),
    (["-m", "no_such_module_xyz"], 1, "neuronlocal run: No module named no_such_module_xyz"),
])
def test_missing_target_is_one_line_and_no_report(tmp_path, args, code, message):
    proc, out = run_cli(tmp_path, args)
    assert proc.returncode == code
    assert proc.stderr.strip() == message.format(tmp=tmp_path)
    assert not out.exists()


def test_report_folder_must_be_private_and_files_are_never_followed(tmp_path):
    path = script(tmp_path, "ok.py", NEURON_WORK)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    proc = subprocess.run([sys.executable, "-m", "neuronlocal", "run", "--report", str(shared),
                           str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "writable by everyone" in proc.stderr
    assert list(shared.iterdir()) == []
    # A planted symlink is replaced, not written through; the files are the user's only.
    out = tmp_path / "report"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (out / "report.html").symlink_to(victim)
    proc, out = run_cli(tmp_path, [str(path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert victim.read_text() == "keep me"
    assert not (out / "report.html").is_symlink()
    assert all((p.stat().st_mode & 0o077) == 0 for p in out.iterdir())


def test_dtype_column_is_summarised():
    assert render.dtypes_summary(["torch.int64"] + ["torch.float32"] * 19) == "int64, 19 x float32"
    assert render.dtypes_summary([]) == ""
