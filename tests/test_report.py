"""`neuronlocal run` reports: recompiles and buckets, fallbacks with call sites, OOM, ranks,
the profiler trace, the metrics API and TORCH_NEURONX_LOG_LEVEL."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from neuronlocal.estimate import view as estimate_view
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
    assert "tensor 'ids' size mismatch at index 1. expected 5, actual 6" in rec[0]["guard"]
    for e, (old, new) in zip(rec, zip(lengths, lengths[1:], strict=False), strict=True):
        assert [(c["name"], c["source"], c["category"], c["dim"], c["before"], c["after"])
                for c in e["changed"]] == [("ids", "L['ids']", "data", 1, old, new)]
        assert e["role"] == "training" and f"ids {old} -> {new}" in e["reason"]  # grad on
        assert "seq.py:" in e["function"]  # the user's line that called the compiled step
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
    assert "compiled again with the shapes of graph_0" in res["recompiles"][1]["reason"]
    assert res["buckets"] == []  # 8 and 16 are already the buckets one would suggest


def _generate_graphs(prompts: list[int], new_tokens: int) -> list[dict]:
    """Records as generate() with a static cache sized per prompt makes them: a prefill and
    a decode graph per call, the decode one fed the cache, whose length follows the prompt."""
    ids = "L['kwargs']['input_ids']"
    weight = "L['args'][0]._modules['lm_head']._parameters['weight']"
    mask, keys = "L['kwargs']['attention_mask']", "L['kwargs']['cache'].layers[0].keys"
    step = "L['kwargs']['cache'].layers[0].cumulative_length"
    out = []
    for p in prompts:
        cache = p + new_tokens - 1
        for names, shapes in (([ids, weight, step], [(1, p), (128, 64), ()]),
                              ([ids, weight, mask, step, keys],
                               [(1, 1), (128, 64), (1, 1, 1, cache), (), (1, 2, cache, 16)])):
            i = len(out)
            out.append({"graph_id": i, "graph_name": f"graph_{i}", "input_shapes": shapes,
                        "input_dtypes": ["torch.int64"] * len(shapes), "kind": "static",
                        "cache": "miss", "compile_seconds": 1.0,
                        "extra": {"compile_id": f"0/{i}", "input_names": names,
                                  "training": False, "user_frame": {
                                      "file": "gen.py", "line": 10, "function": "<module>"}}})
    return out


def test_generate_graphs_are_compared_by_name_and_role():
    from neuronlocal.compile.bucketing import suggest_buckets

    res = analysis.recompiles(_generate_graphs([5, 9, 17], 4), [], {})
    # The fitter's two buckets for these prompts (8, 24 and 16, 24 pad alike).
    two = suggest_buckets([5, 9, 17], max_buckets=2)
    pad = f"pad prompts to buckets {', '.join(map(str, two))}"
    assert len(two) == 2 and two[-1] == 24
    reasons = [(e["graph"], e["role"], e["reason"].split(" (")[0]) for e in res["recompiles"]]
    assert reasons == [
        ("graph_1", "decode", "first decode graph of this function"),
        ("graph_2", "prefill", "prefill graph recompiled: prompt length 5 -> 9; " + pad),
        ("graph_3", "decode", "decode graph recompiled: static cache length 8 -> 12; set "
                              "max_cache_len=32"),
        ("graph_4", "prefill", "prefill graph recompiled: prompt length 9 -> 17; " + pad),
        ("graph_5", "decode", "decode graph recompiled: static cache length 12 -> 20; set "
                              "max_cache_len=32")]
    assert all(e["function"] == "<module> (gen.py:10)" for e in res["recompiles"])
    # Data only: the mask follows the cache and the weight never changes: no bucket for them.
    (b,) = res["buckets"]
    assert (b["name"], b["sizes"], b["buckets"], b["graphs_with_buckets"]) == (
        "input_ids", [5, 9, 17], two, 2)
    # Padded to 24, a call generates 3 tokens past it: 27 rounds up to 32.
    assert res["advice"] == [{"function": "<module> (gen.py:10)", "graphs_now": 6,
                              "graphs_predicted": 3, "max_cache_len": 32,
                              "buckets": {"input_ids": two}}]
    # The same prompts already padded, the cache fixed: nothing left to advise.
    fixed = _generate_graphs([16, 24], 4)
    for g in fixed:
        g["input_shapes"] = [tuple(32 if n in (19, 27) else n for n in s)
                             for s in g["input_shapes"]]
    fixed = [g for g in fixed if g["graph_id"] != 3]  # the decode graph is compiled once
    res = analysis.recompiles(fixed, [], {})
    assert res["buckets"] == [] and res["advice"] == []


def test_notes_on_library_use(monkeypatch):
    from neuronlocal.core import counters
    from neuronlocal.report import collect

    seen: dict[str, int] = {}
    monkeypatch.setattr(counters, "user_counters", lambda: seen)
    monkeypatch.delenv("HF_DEACTIVATE_ASYNC_LOAD", raising=False)
    assert collect.notes(4) == []
    seen.update(hf_weight_loads=1, hf_generate_bypassed_compile=1)
    generate, loads = collect.notes(4)
    assert "model.forward = torch.compile(model.forward" in generate
    assert "on 4 ranks" in loads and "HF_DEACTIVATE_ASYNC_LOAD=1" in loads
    assert len(collect.notes(1)) == 1  # one process: the threaded loader is fine
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")
    assert len(collect.notes(4)) == 1


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
    from neuronlocal.core.files import temp_prefix
    from neuronlocal.report import child, runner

    state = tmp_path / ".state-mine.json"
    child.write_state(state, {"status": "running", "report": None})
    cut_off = tmp_path / f"{temp_prefix(state)}x1y2.tmp"
    cut_off.write_text('{"status": "runn')
    other = tmp_path / f"{temp_prefix(tmp_path / '.state-other.json')}a1b2.tmp"
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
    assert proc.returncode == 2 and "can be written by other users" in proc.stderr
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


def test_report_folder_writable_by_the_group_is_refused(tmp_path):
    from neuronlocal.report import runner

    shared = tmp_path / "group"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(runner.RunError, match=r"can be written by other users \(mode 770\)"):
        runner._check_writable(shared)
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="a link owned by another user needs root to make")
def test_report_folder_through_another_users_link_is_refused(tmp_path):
    from neuronlocal.report import runner

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, 65534, 65534)  # planted by another user, pointing at the victim's folder
    with pytest.raises(runner.RunError, match="symbolic link owned by another user"):
        runner._check_writable(link)
    assert list(mine.iterdir()) == []


def test_dtype_column_is_summarised():
    assert render.dtypes_summary(["torch.int64"] + ["torch.float32"] * 19) == "int64, 19 x float32"
    assert render.dtypes_summary([]) == ""


def test_sigkill_report_says_when_the_host_oom_killer_may_have_sent_it(tmp_path, monkeypatch):
    import signal

    from neuronlocal.core import hardware
    from neuronlocal.report import runner

    written: list[dict] = []
    monkeypatch.setattr(runner, "write", lambda out, rep, quiet=False: written.append(rep))
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096,
                                                     "SC_PHYS_PAGES": 2**18}[name])  # 1 GiB
    state = tmp_path / ".state.json"
    state.write_text(json.dumps({"status": "running", "report": {"run": {"seconds": 1.0}}}))
    assert runner._report_for_child(tmp_path, state, -signal.SIGKILL, 2.0, True) == 137
    message = written[0]["run"]["error"]["message"]
    assert "killed by SIGKILL" in message and "OOM killer" in message
    assert hardware.host_memory_note(hardware.profile(hardware.Config())) in message
    state.write_text(json.dumps({"status": "running", "report": {"run": {"seconds": 1.0}}}))
    runner._report_for_child(tmp_path, state, -signal.SIGSEGV, 2.0, True)
    assert "OOM killer" not in written[1]["run"]["error"]["message"]


# ---- the HTML page: wide-window layout, folded reasons, compile split, errors once ------------

_TP_ERROR = ("neuron could not compile graph 'llama_graph_3' (412 nodes): RuntimeError: "
             "Attempted to set the storage of a tensor on device \"meta\" to a storage on "
             "different device \"neuron:{rank}\"")
_TRACEBACK = ('Traceback (most recent call last):\n  File "/home/u/train_tp.py", line 41, in '
              '<module>\n    loss = model(input_ids=ids, labels=ids).loss\n  File "/venv/lib/'
              'python3.11/site-packages/torch/_dynamo/eval_frame.py", line 900, in _fn\n'
              '    return fn(*args)\nNEFFCompilationError: {msg}\n')
_LONG_GUARD = ("0/3: len(L['kwargs']) == 6  # in transformers/utils/deprecation.py:172; "
               + "; ".join(f"tensor L['past_key_values'].layers[{i}].keys size mismatch at "
                           f"index 2. expected 17, actual 21" for i in range(12)))


def _rank_report(rank: int, world: int) -> dict[str, Any]:
    """A rank of a failed TP x FSDP job, shaped as collect.snapshot writes it."""
    msg = _TP_ERROR.format(rank=rank)
    graph = {"graph_id": 0, "graph_name": "llama_graph_0", "node_count": 900,
             "input_shapes": [[2, 128]] + [[4096, 4096]] * 40,
             "input_dtypes": ["torch.int64"] + ["torch.float32"] * 40, "compile_seconds": 121.5,
             "cache": "miss", "kind": "static", "extra": {}}
    steps = [{"step": i, "host_s": 121.9 if i == 0 else 0.41 + 0.01 * i,
              "compile_s": 121.5 if i == 0 else 0.0, "estimated_s": 0.012, "band_s": [0.01, 0.015],
              "eager_s": 0.001, "graph_s": 0.011, "eager_ops": 30, "graph_calls": 2,
              "tensor_flops": 1e9} for i in range(6)]
    return {
        "schema": 1, "rank": rank, "world_size": world, "instance": "trn2.48xlarge, LNC=2",
        "config_error": None,
        "run": {"argv": ["train_tp.py", "--tp", "2"], "seconds": 130.0, "exit_code": 1,
                "ended_by": "exception", "error": {"type": "NEFFCompilationError", "message": msg,
                                                   "traceback": _TRACEBACK.format(msg=msg)}},
        "graphs": [graph, {**graph, "graph_id": 1, "graph_name": "llama_graph_1",
                           "compile_seconds": 3.0}],
        "recompiles": [{"graph": "llama_graph_1", "function": "forward (train_tp.py:30)",
                        "kind": "static", "cache": "miss", "reason": _LONG_GUARD}],
        "bucket_suggestions": [],
        "graph_breaks": [{"count": 1, "reason": "Failed to trace builtin operator",
                          "detail": "Explanation: Dynamo does not know how to trace print\n"
                                    "Hint: avoid print", "file": "/home/u/train_tp.py",
                          "line": 12, "source": "print(loss)"}],
        "fallback_ops": [], "downcast_ops": {}, "collectives": [],
        "memory": [{"core": rank, "peak_bytes": 2 ** 30, "reserved_peak_bytes": 2 ** 31,
                    "hbm_bytes": 24 * 2 ** 30, "num_ooms": 0,
                    "timeline": [[0.5, 2 ** 29], [1.0, 2 ** 30], [2.0, 2 ** 29]]}],
        "eager_ops": {"aten::mm": 10},
        "estimate": {"instance": "trn2.48xlarge", "lnc": 2, "band": 0.2, "step_band": 0.3,
                     "held_out_median_error": 0.1, "steps": steps, "graphs": [],
                     "summary": None},
    }


def _tp_job(world: int = 4) -> dict[str, Any]:
    return render.merge([_rank_report(r, world) for r in range(world)])


def test_html_page_errors_once_reasons_folded_compile_apart():
    rep = _tp_job()
    page = render.html_page(rep)
    # one error section for the job, naming the ranks, the failing graph and the user's line
    assert page.count("<h2 id='error-") == 1 and "Error (ranks 0-3)" in page
    assert "failing graph: <b>llama_graph_3</b>" in page
    assert "/home/u/train_tp.py:41 in &lt;module&gt;" in page
    lines = render.headline(rep)
    assert len([h for h in lines if "NEFFCompilationError" in h]) == 1
    assert lines[0].startswith("ranks 0-3: the script raised NEFFCompilationError")
    # the long guard is one line that opens to the whole text; so is the graph break detail
    assert "<details><summary>0/3: len(L[&#x27;kwargs&#x27;]) == 6" in page
    assert "Hint: avoid print" in page
    # compile seconds have their own chart: the per-step chart's largest bar is a run time
    run_ms = [v for _, v, _ in estimate_view.bars(rep)]
    assert max(run_ms) < 1000
    assert [(label, v) for label, v, _ in estimate_view.compile_bars(rep)][0] == \
        ("r0 step 0 compile", 121.5)
    assert "<script" not in page


def test_piped_summary_is_not_cut_at_80_columns(monkeypatch):
    import io

    piped = io.StringIO()  # not a tty, as `neuronlocal run ... 2>&1 | tee log`
    monkeypatch.setattr(sys, "stderr", piped)
    render.terminal(render.merge([_rank_report(0, 1)]))
    widths = [len(line) for line in piped.getvalue().splitlines()]
    assert 80 < max(widths) <= render.PIPED_WIDTH
    assert "forward (train_tp.py:30)" in piped.getvalue()  # a whole cell on one line


def test_report_page_fits_a_wide_window(tmp_path):
    """In headless Chromium at 1400 px: nothing wider than the window (with every <details>
    open, too), the content uses the window, no cell is a wall of text."""
    from conftest import page_layout

    layout = page_layout(render.html_page(_tp_job()), tmp_path)
    for state in ("shown", "opened"):
        m = layout[state]
        assert m["over"] == [] and m["scroll"] <= m["viewport"], (state, m)
    shown = layout["shown"]
    assert shown["body"] >= 0.9 * shown["viewport"], shown
    assert shown["tallest_cell"] < 120, shown
    narrow = page_layout(render.html_page(_tp_job()), tmp_path, width=700)["shown"]
    assert narrow["scroll"] <= narrow["viewport"], narrow


BREAK_SCRIPT = """\
import torch

def f(x):
    x = x + 1
    print("BREAK-HERE")
    return x * 2

torch.compile(f, backend="eager")(torch.ones(4, device="neuron"))  # Dynamo only: fast
"""


def test_graph_break_logs_stay_out_of_stderr(tmp_path):
    """The report collects Dynamo's graph-break records; they do not reach the user's stderr
    (only TORCH_LOGS=graph_breaks, the user's own choice, prints them)."""
    proc, out = run_cli(tmp_path, [str(script(tmp_path, "brk.py", BREAK_SCRIPT))])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[__graph_breaks]" not in proc.stderr and "Graph Break Reason" not in proc.stderr
    (b,) = _report(out)["graph_breaks"]
    assert b["reason"] == "Failed to trace builtin operator" and b["line"] == 5


SKIPPED_FUNCTION = """\
Failed to handle graph break gracefully. Skipping the function and falling back to eager. \
Graph break encountered:

HOP: Unsafe side effect
  Higher Order Operator: torch.utils.checkpoint.checkpoint
  Explanation: Mutating a variable from outside the scope of this HOP is not supported.
  Hint: If you are ok with side-effect not replayed in the backward, try setting `flag = True`

  Developer debug context: Attempted to mutate UserDefinedObjectVariable(CompileableContextVar)
"""


def test_a_break_that_runs_its_whole_function_eagerly_says_so():
    """Dynamo's "Skipping the function" header is not the reason: the break's kind is, and
    the report says the function ran eagerly (one launch per op) and gives Dynamo's hint."""
    from neuronlocal.report import collect

    parts = collect.break_parts(SKIPPED_FUNCTION)
    assert parts == {"reason": "HOP: Unsafe side effect", "whole_function_eager": True,
                     "hint": "If you are ok with side-effect not replayed in the backward, "
                             "try setting `flag = True`"}
    resumed = collect.break_parts(SKIPPED_FUNCTION.replace(collect._EAGER, "Encountered graph "
                                                           "break when attempting to trace"))
    assert resumed == {**parts, "whole_function_eager": False}
    rank = _rank_report(0, 1)
    rank["graph_breaks"] = [{**parts, "count": 3, "detail": SKIPPED_FUNCTION, "line": 507,
                             "file": "/x/layer.py", "source": "self.global_var = value"}]
    page = render.html_page(render.merge([rank]))
    assert "HOP: Unsafe side effect; the whole function ran eagerly" in page
    assert "try setting `flag = True`" in page
    assert "3 graph break(s), 3 of them ran their whole function eagerly" in render.headline(
        render.merge([rank]))


def test_collector_keeps_graph_break_logs_the_user_enabled():
    import logging

    from neuronlocal.report import collect

    log = logging.getLogger(collect._BREAK_LOGGER)
    saved = (log.level, log.propagate)
    try:
        log.setLevel(logging.DEBUG)  # as TORCH_LOGS=graph_breaks sets it
        log.propagate = True
        c = collect.Collector().start(reset=False)
        assert log.propagate
        c.stop()
        log.setLevel(logging.NOTSET)  # not enabled: collected, not propagated
        c = collect.Collector().start(reset=False)
        assert not log.propagate and log.level == logging.DEBUG
        c.stop()
        assert log.propagate and log.level == logging.NOTSET
    finally:
        log.setLevel(saved[0])
        log.propagate = saved[1]


FALLBACK_GENERATE_SCRIPT = """\
import torch, transformers
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(cfg).to("neuron").eval()
for n in (3, 5, 7):
    ids = torch.arange(1, n + 1, device="neuron")[None]
    model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
"""


BROKEN_ESTIMATOR = """\
import sys
import torch
from neuronlocal.estimate import capture, counting
from neuronlocal.report import analysis, collect


def boom(*args, **kwargs):
    raise RuntimeError("estimator broke")


counting._may_warn = boom  # the eager op counter's own decisions
capture.Capture._step = boom  # the optimizer-step hook
analysis.recompiles = boom  # the report's analysis
collect.memory = boom  # a report section
torch.manual_seed(0)
m = torch.nn.Linear(4, 4).to("neuron")
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(2):
    loss = m(torch.ones(2, 4, device="neuron")).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("result", (m.weight * 2 + 1).sum(1).tolist(), round(loss.item(), 4))
sys.exit(3)
"""


def test_a_failing_estimator_or_report_leaves_the_job_as_it_was(tmp_path):
    path = script(tmp_path, "broken.py", BROKEN_ESTIMATOR)
    env = {**os.environ, "TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff"),
           "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "locks")}
    alone = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    assert alone.returncode == 3 and alone.stdout.startswith("result ["), alone.stderr[-2000:]
    proc, out = run_cli(tmp_path, [str(path)])
    assert (proc.returncode, proc.stdout) == (alone.returncode, alone.stdout), proc.stderr[-3000:]
    r = json.loads((out / "report.json").read_text())["ranks"][0]
    missing = "\n".join(r["not_estimated"])
    for what in ("eager ops: RuntimeError: estimator broke",
                 "training step: RuntimeError: estimator broke",
                 "recompile analysis: RuntimeError: estimator broke",
                 "memory: RuntimeError: estimator broke"):
        assert what in missing, missing
    assert r["memory"] == [] and r["recompiles"] == [] and r["estimate"]["steps"] == []
    assert "not estimated: training step: RuntimeError: estimator broke" in proc.stderr
    assert "not estimated: recompile analysis" in (out / "report.html").read_text()


SFT_SCRIPT = """\
import tempfile
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

texts = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(8)]
tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
specials = ["<unk>", "<pad>", "<eos>"]
tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials))
tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                              eos_token="<eos>")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=2,
                 learning_rate=1e-3, logging_steps=1, report_to=[], torch_compile=True,
                 max_length=16, save_strategy="no", seed=0, disable_tqdm=True)
assert args.gradient_checkpointing  # TRL's default
trainer = SFTTrainer(model=LlamaForCausalLM(cfg), args=args, processing_class=tok,
                     train_dataset=Dataset.from_dict({"text": texts}))
trainer.train()
print("losses", [h["loss"] for h in trainer.state.log_history if "loss" in h])
"""


HINT = "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True"


@pytest.mark.slow
def test_compiled_sft_with_gradient_checkpointing_under_run(tmp_path):
    """TRL's SFTTrainer(torch_compile=True) keeps activation checkpointing on. With `kernels`
    installed, transformers' kernelized attention sets a context variable inside each
    checkpointed layer, a side effect Dynamo cannot replay, so Dynamo runs the whole model
    eagerly (on CPU too): the report must say so and give Dynamo's hint. With the hint
    applied the model compiles, and the op counter costs its higher-order operators."""
    def run(name: str, code: str) -> tuple[list[float], dict[str, Any]]:
        (tmp_path / name).mkdir()
        proc, out = run_cli(tmp_path / name, [str(script(tmp_path, f"{name}.py", code))],
                            timeout=1200)
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses = json.loads(proc.stdout.split("losses ", 1)[1].replace("'", '"'))
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
        r = json.loads((out / "report.json").read_text())["ranks"][0]
        assert r["run"]["error"] is None and r["not_estimated"] == []
        return losses, r

    losses, r = run("as_written", SFT_SCRIPT)
    side = [b for b in r["graph_breaks"]
            if b["whole_function_eager"] and b["reason"] == "HOP: Unsafe side effect"]
    assert side and HINT in side[0]["hint"], r["graph_breaks"]
    assert not any(g["estimate"]["tensor_flops"] for g in r["graphs"])  # no matmul compiled
    assert r["eager_ops"]["aten::mm"] > 0  # the model's matmuls ran op by op

    applied = SFT_SCRIPT.replace("import torch\n", f"import torch\n{HINT}\n", 1)
    fixed, r = run("hint_applied", applied)
    assert fixed == pytest.approx(losses, rel=1e-5)  # the hint changes no number here
    assert not any(b["reason"] == "HOP: Unsafe side effect" for b in r["graph_breaks"])
    # The model's graph (the loss is another): its backward recomputes the checkpointed
    # forward, so it costs more than twice the forward's matmuls.
    model = max((g for g in r["graphs"] if g["extra"]["training"]), key=lambda g: g["node_count"])
    est = model["estimate"]
    assert est["backward_tensor_flops"] > 2 * est["tensor_flops"] > 0
    assert all(g["extra"]["user_frame"]["file"].endswith("hint_applied.py") for g in r["graphs"])
    steps = r["estimate"]["steps"]
    assert len(steps) == 2 and all(s["graph_calls"] > 0 and s["estimated_s"] > 0 for s in steps)


GENERATE_SCRIPT = """\
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from neuronlocal.compile.bucketing import pad_to_bucket

torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
model = LlamaForCausalLM(cfg).to("neuron").eval()
model.forward = torch.compile(model.forward, backend="neuron")
buckets = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else None
extra = {"max_cache_len": int(sys.argv[2])} if len(sys.argv) > 2 else {}
for n in (5, 9, 17):
    ids = torch.randint(3, 128, (1, n), device="neuron")
    if buckets:
        ids, mask = pad_to_bucket(ids, buckets, pad_id=0, side="left")
        extra["attention_mask"] = mask
    out = model.generate(ids, max_new_tokens=4, cache_implementation="static",
                         do_sample=False, pad_token_id=0, **extra)
    print(n, tuple(out.shape))
"""


@pytest.mark.slow
def test_fallback_warnings_once_per_op_across_generate_calls(tmp_path):
    """generate() called three times under `neuronlocal run` (whose capture shows every
    fallback warning to find its call site): each fallback op is warned about once."""
    pytest.importorskip("transformers")
    proc, out = run_cli(tmp_path, [str(script(tmp_path, "gen.py", FALLBACK_GENERATE_SCRIPT))],
                        env={"PYTHONWARNINGS": "always"})  # a repeat would show
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line.split("UserWarning: ")[1].split()[0] for line in proc.stderr.splitlines()
              if "executed via CPU fallback" in line]
    assert "aten::argmax.out" in warned and len(warned) == len(set(warned)), warned
    calls = {f["op"]: f["count"] for f in _report(out)["fallback_ops"]}
    assert calls["aten::argmax.out"] >= 9  # three calls of three tokens each, warned once


@pytest.mark.slow
def test_generate_recompiles_are_named_and_the_advice_holds(tmp_path):
    """Compiled forward, static cache sized per prompt: the report names the cache length as
    the decode graphs' cause, suggests max_cache_len and prompt buckets (data only), and the
    job replayed with them compiles the number of graphs the report predicted."""
    path = script(tmp_path, "gen.py", GENERATE_SCRIPT)
    proc, out = run_cli(tmp_path, [str(path)], timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((out / "report.json").read_text())["ranks"][0]
    rec = r["recompiles"]
    assert len(r["graphs"]) == len(rec) + 1
    roles = [e["role"] for e in rec]
    assert roles.count("decode") >= 2 and roles.count("prefill") == 2
    (advice,) = r["recompile_advice"]
    cache = advice["max_cache_len"]
    decode = [e for e in rec if e["role"] == "decode"]
    first, *later = decode
    assert first["reason"].startswith("first decode graph")
    for e in later:
        m = re.fullmatch(r"decode graph recompiled: static cache length (\d+) -> (\d+); "
                         r"set max_cache_len=(\d+)", e["reason"])
        assert m and int(m.group(3)) == cache > int(m.group(2)) > int(m.group(1)), e["reason"]
        assert e["guard"]  # Dynamo's raw guard, kept beside the cause
    prefill = [e for e in rec if e["role"] == "prefill"]
    assert [e["reason"].split(";")[0] for e in prefill] == [
        "prefill graph recompiled: prompt length 5 -> 9",
        "prefill graph recompiled: prompt length 9 -> 17"]
    # Attributed to the user's line, compared by name: never a weight in a suggestion.
    assert all(e["function"].startswith(f"<module> ({path}:") for e in rec)
    (b,) = r["bucket_suggestions"]
    assert (b["role"], b["name"], b["dim"], b["sizes"]) == ("prefill", "input_ids", 1, [5, 9, 17])
    assert "_parameters" not in b["source"] and b["graphs_with_buckets"] < 3
    assert advice["graphs_predicted"] < advice["graphs_now"] == len(r["graphs"])

    replay = tmp_path / "replay"
    replay.mkdir()
    proc, out = run_cli(replay, [str(path), ",".join(map(str, b["buckets"])), str(cache)],
                        timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r2 = json.loads((out / "report.json").read_text())["ranks"][0]
    assert len(r2["graphs"]) == advice["graphs_predicted"]
    assert r2["recompile_advice"] == [] and r2["bucket_suggestions"] == []


def test_recompile_cause_comes_from_the_failed_guard_when_no_shape_changed():
    """A second Dynamo compile of a frame with the same shapes (torchtitan: an input became an
    AsyncCollectiveTensor) is explained by its failed guard, never by automatic dynamic
    shapes; a graph the backend specialised per shape still is."""

    class Metric:
        co_name, co_filename, co_firstlineno = "step", "train.py", 1
        recompile_reason = ("0/1: tensor 'L['x']' dispatch key set mismatch. expected "
                            "DispatchKeySet(PrivateUse1), actual DispatchKeySet(Python)")

    def g(i, shapes, cid, kind="static"):
        return {"graph_id": i, "graph_name": f"graph_{i}", "input_shapes": shapes,
                "input_dtypes": ["torch.float32"], "kind": kind, "cache": "miss",
                "compile_seconds": 0.1, "extra": {"compile_id": cid}}

    res = analysis.recompiles([g(0, [(2, 8)], "0/0"), g(1, [(2, 8)], "0/1")], [],
                              {"0/1": Metric()})
    (entry,) = res["recompiles"]
    assert "automatic dynamic" not in entry["reason"], entry
    assert "an input's type changed" in entry["reason"]
    assert "dispatch key set mismatch" in entry["reason"]
    spec = analysis.recompiles([g(0, [(2, 8)], "0/0", "specialized"),
                                g(1, [(2, 16)], "0/0", "specialized"),
                                g(2, [(2, 8)], "0/0", "specialized")], [], {})
    assert "automatic dynamic" in spec["recompiles"][1]["reason"]


# ---- user text is never rich markup ------------------------------------------------------

_MARKUP = "[/INST] [bold red]x[/] [/tmp] :smile:"


def test_summary_prints_user_text_as_written(monkeypatch):
    """argv, error messages, graph break sources and op names are printed as they are: rich
    would read `[/INST]` as a closing tag and raise, or eat `[bold red]` as a style."""
    import io

    rank = _rank_report(0, 1)
    rank["run"]["argv"] = ["train.py", _MARKUP]
    rank["run"]["error"] = {"type": "ValueError", "message": f"bad {_MARKUP}", "traceback": ""}
    rank["graph_breaks"][0]["source"] = f"print('{_MARKUP}')"
    rank["eager_ops"] = {f"aten::{_MARKUP}": 3}
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    render.terminal(render.merge([rank]))
    out = piped.getvalue()
    assert f"train.py {_MARKUP}" in out and f"bad {_MARKUP}" in out
    assert f"aten::{_MARKUP} 3" in out


def test_run_with_markup_in_argv_and_error_keeps_the_report_and_status(tmp_path):
    """Neither the summary nor the exit status depends on what the script's text holds."""
    ok = script(tmp_path, "ok.py", NEURON_WORK)
    proc, out = run_cli(tmp_path, [str(ok), _MARKUP])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"ok.py {_MARKUP}" in proc.stderr and "could not" not in proc.stderr
    r = _report(out)
    assert r["run"]["argv"][-1] == _MARKUP and r["run"]["ended_by"] == "return"
    bad = script(tmp_path, "bad.py", NEURON_WORK + f"raise ValueError({_MARKUP!r})\n")
    proc, out = run_cli(tmp_path, [str(bad)])
    assert proc.returncode == 1 and "could not" not in proc.stderr, proc.stderr[-2000:]
    r = _report(out)
    assert r["run"]["error"]["message"] == _MARKUP and r["run"]["ended_by"] == "exception"
    code = f"import neuronlocal.report.metrics as m\nraise SystemExit(0 if {_MARKUP!r} in " \
           "m.report() else 3)\n"
    inside = script(tmp_path, "inside.py", f"import sys\nsys.argv.append({_MARKUP!r})\n" + code)
    assert subprocess.run([sys.executable, str(inside)], timeout=120).returncode == 0


def test_a_summary_that_cannot_print_leaves_the_full_report(tmp_path, monkeypatch):
    """A summary that fails (a closed stderr, a rendering bug) is one line; the report on disk
    is the full one and no error escapes."""
    from neuronlocal.report import runner

    def broken(rep, console=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(render, "terminal", broken)
    rank = _rank_report(0, 1)
    (tmp_path / "rep").mkdir(mode=0o700)
    rep = runner.write(tmp_path / "rep", rank)
    assert rep["complete"]
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["ranks"][0]["run"] == \
        rank["run"]


# ---- one job's report holds only that job's ranks ------------------------------------------

# As torchrun: an agent whose own environment has no TORCHELASTIC_RUN_ID starts the rank
# with TORCHELASTIC_RUN_ID=none (what --master-port gives every job) and the rank variables.
_AGENT = ("import os, subprocess, sys; os.environ.update(TORCHELASTIC_RUN_ID='none', "
          "MASTER_PORT='29511', WORLD_SIZE='2', LOCAL_WORLD_SIZE='2', RANK=sys.argv[1]); "
          "sys.exit(subprocess.call(sys.argv[2:]))")


def test_a_later_job_into_the_same_folder_never_merges_an_earlier_jobs_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    failed = script(tmp_path, "failed.py", NEURON_WORK + "raise ValueError('job one')\n")
    ok = script(tmp_path, "ok.py", NEURON_WORK)
    for rank, path in ((1, failed), (0, ok)):  # job one's rank 1, then job two's rank 0
        cmd = [sys.executable, "-c", _AGENT, str(rank), sys.executable, "-m", "neuronlocal",
               "run", "--report", str(tmp_path / "report"), str(path)]
        subprocess.run(cmd, env=env, capture_output=True, timeout=300, check=False)
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [r["rank"] for r in rep["ranks"]] == [0] and not rep["complete"]
    assert rep["ranks"][0]["run"]["error"] is None and "job one" not in json.dumps(rep)


def test_only_the_tools_own_rank_files_are_merged(tmp_path):
    """A user's rankings.json (or rank_notes.json, rank1.json.bak) in the report folder is
    not a rank file; a bad WORLD_SIZE is one warning, and the run still gets its report."""
    out = tmp_path / "report"
    out.mkdir(mode=0o700)
    (out / "rankings.json").write_text('{"top": [1, 2]}')
    (out / "rank_notes.json").write_text("[1, 2]")
    (out / "rank7.json").write_text('{"rank": 7, "run": "not a run"}')
    ok = script(tmp_path, "ok.py", NEURON_WORK)
    proc, out = run_cli(tmp_path, [str(ok)], env={"WORLD_SIZE": "abc"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "WORLD_SIZE='abc' is not a whole number >= 1" in proc.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["complete"] and [r["rank"] for r in rep["ranks"]] == [0]
    assert rep["world_size"] == 1
