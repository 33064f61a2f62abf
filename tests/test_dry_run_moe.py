"""Dry run of mixture-of-experts models: the routing policy and the values it keeps.

A dry run has no router logits, so the indices topk picks from them follow the routing
policy (balanced, as Megatron's forced load balancing, or a hot expert 0), while the index
math on them (bincount, argsort, one_hot, where, `.tolist()` split sizes, all_to_all of
counts) computes for real. The tests hold the per-expert token counts to the policy's, the
peak HBM to a real run whose router is forced to the same balanced routing, and the
all_to_all bytes of expert parallelism to their closed form."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

DRY = {"NEURONLOCAL_DRY_RUN": "1", "OMP_NUM_THREADS": "1"}

# Token-choice top-2 over 8 experts, per-expert loops as torchtitan (argsort, bincount,
# `.tolist()` split sizes) or HF Mixtral / Qwen3-MoE (one_hot, where) route. The router's
# bias forces the balanced routing in a real run: token r's j-th choice is expert
# (r*K + j) mod E, the dry run's balanced pattern (its bias, a float from the host, is a
# value the dry run does not compute with).
MOE = """\
    import json, sys, torch
    import torch.nn as nn
    import torch.nn.functional as F
    from neuronlocal.core import dryrun
    style = sys.argv[1]
    dev = torch.device("neuron")
    torch.manual_seed(0)
    E, K, H, FF, T = 8, 2, 64, 128, 256
    force = torch.zeros(T, E)
    for r in range(T):
        for j in range(K):
            force[r, (r * K + j) % E] = 100.0 * (K - j)

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(H, E, bias=False)
            self.w1 = nn.Parameter(torch.randn(E, H, FF) * 0.02)
            self.w2 = nn.Parameter(torch.randn(E, FF, H) * 0.02)
            self.register_buffer("force", force)

        def forward(self, x):
            probs = (self.router(x) + self.force).softmax(-1)
            weights, idx = probs.topk(K, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            counts = []
            if style == "titan":
                flat = idx.view(-1)
                order = flat.argsort(stable=True)
                sizes = torch.bincount(flat, minlength=E).tolist()
                start = 0
                for e, n in enumerate(sizes):
                    rows = order[start:start + n]
                    tok = rows // K
                    h = F.silu(x[tok] @ self.w1[e]) @ self.w2[e]
                    out.index_add_(0, tok, h * weights.view(-1)[rows].unsqueeze(-1))
                    counts.append(n)
                    start += n
            else:
                mask = F.one_hot(idx, num_classes=E).permute(2, 1, 0)
                for e in range(E):
                    pos, tok = torch.where(mask[e])
                    h = F.silu(x[tok] @ self.w1[e]) @ self.w2[e]
                    out.index_add_(0, tok, h * weights[tok, pos, None])
                    counts.append(int(tok.numel()))
            return out, counts

    model = MoE().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randn(T, H, device=dev)
        out, counts = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    s = torch.neuron.memory_stats(0)
    print(json.dumps({"counts": counts, "peak": s["allocated_bytes.all.peak"],
                      "reserved": s["reserved_bytes.all.peak"], "reads": dryrun.reads()}))
    """


def _line_of(code: str, text: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(code).splitlines(), 1)
                if text in line)


def run_code(code: str, args: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("style", ["titan", "hf"])
def test_moe_dry_run_routes_balanced_and_counts_the_real_runs_hbm(style):
    """Each expert gets T*K/E tokens, as the forced-balanced real run gives them, and the
    peak HBM is the real run's (within 3%); the topk site is listed with its line."""
    real = run_code(MOE, [style], {"OMP_NUM_THREADS": "1"})
    dry = run_code(MOE, [style], DRY)
    assert real["counts"] == [256 * 2 // 8] * 8  # the forcing router works
    assert dry["counts"] == real["counts"]
    assert abs(dry["peak"] - real["peak"]) <= 0.03 * real["peak"], (dry["peak"], real["peak"])
    assert abs(dry["reserved"] - real["reserved"]) <= 0.03 * real["reserved"]
    topk = [r for r in dry["reads"] if r["op"].startswith("aten::topk indices")]
    assert len(topk) == 1 and topk[0]["count"] == 2, dry["reads"]
    assert "balanced routing over 8 (2 per row)" in topk[0]["op"]
    assert topk[0]["at"] == f"<string>:{_line_of(MOE, '.topk(')}", topk
    # the index math ran on real values: nothing else was assumed
    assert not [r for r in dry["reads"] if "nonzero" in r["op"] or ".item()" in r["op"]
                or "copy of a neuron tensor" in r["op"]], dry["reads"]


def test_hot_routing_puts_its_fraction_of_tokens_on_expert_0():
    dry = run_code(MOE, ["titan"], {**DRY, "NEURONLOCAL_DRY_RUN_ROUTING": "hot:0.5"})
    counts = dry["counts"]
    assert counts[0] == 128 and sum(counts) == 512, counts  # half of the 256 tokens
    assert max(counts[1:]) - min(counts[1:]) <= 1, counts  # the rest balanced
    worst = run_code(MOE, ["hf"], {**DRY, "NEURONLOCAL_DRY_RUN_ROUTING": "hot:1"})
    assert worst["counts"][0] == 256, worst["counts"]
    assert any("hot routing (a fraction 1 of the rows on index 0)" in r["op"]
               for r in worst["reads"])


def test_bad_routing_is_a_configuration_error():
    proc = subprocess.run([sys.executable, "-c", "import torch; torch.ones(1, device='neuron')"],
                          env={**os.environ, **DRY, "NEURONLOCAL_DRY_RUN_ROUTING": "hot:2"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "NEURONLOCAL_DRY_RUN_ROUTING='hot:2' is not a routing policy" in proc.stderr


def test_values_the_run_has_compute_and_values_it_lacks_do_not():
    """Integer data from the host and ops on it hold values; float data and what it feeds
    stay data-less (zero, reported)."""
    r = run_code("""\
        import json, torch
        from neuronlocal import _C
        from neuronlocal.core import dryrun
        dev = "neuron"
        ids = torch.tensor([3, 1, 3, 0, 2], device=dev)
        counts = torch.bincount(ids, minlength=5)
        csum = counts.cumsum(0)
        mask = ids == 3
        picked = torch.arange(5, device=dev)[mask]
        f = torch.randn(5, device=dev)
        mixed = f[ids] + counts[:5]
        print(json.dumps({"counts": counts.tolist(), "csum": csum.tolist(),
                          "picked": picked.tolist(), "total": int(ids.sum()),
                          "ones": torch.ones(4, device=dev).sum().item(),
                          "mixed": _C._dry_has_values(mixed), "f": f.sum().item(),
                          "reads": [e["op"] for e in dryrun.reads()]}))
        """, [], DRY)
    assert r["counts"] == [1, 1, 1, 2, 0] and r["csum"] == [1, 2, 3, 5, 5]
    assert r["picked"] == [0, 2] and r["total"] == 9 and r["ones"] == 4.0
    assert r["mixed"] is False and r["f"] == 0.0
    assert r["reads"] == ["aten::_local_scalar_dense (.item())"], r["reads"]


EP = """\
    import json, torch
    import torch.distributed as dist
    dist.init_process_group("neuron")
    ws, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("neuron")
    E, K, H, T = 8, 2, 32, 64
    local = E // ws
    torch.manual_seed(0)
    router = torch.randn(H, E, device=dev)
    w = torch.randn(local, H, H, device=dev)
    x = torch.randn(T, H, device=dev)
    _, idx = (x @ router).topk(K, dim=-1)
    flat = idx.view(-1)
    counts = torch.bincount(flat, minlength=E)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts)
    send_splits = counts.view(ws, local).sum(1).tolist()
    recv_splits = got.view(ws, local).sum(1).tolist()
    order = flat.argsort(stable=True)
    send = x[order // K]
    recv = send.new_empty(sum(recv_splits), H)
    dist.all_to_all_single(recv, send, recv_splits, send_splits)
    out = torch.empty_like(recv)
    start = 0
    for src in range(ws):
        for e, n in enumerate(got.view(ws, local)[src].tolist()):
            out[start:start + n] = recv[start:start + n] @ w[e]
            start += n
    back = torch.empty_like(send)
    dist.all_to_all_single(back, out, send_splits, recv_splits)
    print("splits", rank, json.dumps([send_splits, recv_splits]))
    dist.destroy_process_group()
    """


def test_expert_parallel_all_to_all_on_four_simulated_ranks(tmp_path):
    """Experts exchanged by all_to_all over 4 ranks: the count exchange and the two token
    exchanges are recorded with their bytes, and the split sizes are the balanced ones."""
    (tmp_path / "ep.py").write_text(textwrap.dedent(EP))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff"),
           "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "locks")}
    out = tmp_path / "dry"
    proc = subprocess.run([sys.executable, "-m", "neuronlocal", "run", "--dry-run",
                           "--report", str(out), "--nproc-per-node", "4", "ep.py"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "splits 0 [[32, 32, 32, 32], [32, 32, 32, 32]]" in proc.stdout, proc.stdout
    assert "splits 3 [[32, 32, 32, 32], [32, 32, 32, 32]]" in proc.stdout, proc.stdout
    s = json.loads((out / "report.json").read_text())["dry_run"]
    a2a = [c for c in s["collectives"] if c["op"] == "all_to_all_single"]
    # 8 int64 counts, then 64 tokens x 2 choices x 32 float32 each way
    assert a2a == [{**a2a[0], "group_size": 4, "calls": 3, "bytes": 8 * 8 + 2 * 128 * 32 * 4}]
    site = f"ep.py:{_line_of(EP, '.topk(')}"
    assert any("aten::topk indices at" in a and site in a for a in s["assumptions"]), \
        s["assumptions"]


# The tail of the HF MoE scripts: tokens per expert in each layer, as the experts' loop sees
# them, and the dry run's assumed values.
EXPERT_COUNTS = """\
    counts = []
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_hook(lambda m, a, o: counts.append(
            torch.bincount(a[1].reshape(-1), minlength=8).tolist()))
    ids = torch.randint(0, 256, (2, 32), device="neuron")
    model(ids, labels=ids).loss.backward()
    print(json.dumps({"counts": counts, "reads": dryrun.reads()}))
    """


HF_MOE = """\
    import json, sys, torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from neuronlocal.core import dryrun
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    with torch.device("neuron"):
        model = Qwen3MoeForCausalLM(cfg)
""" + EXPERT_COUNTS


def test_hf_qwen3_moe_dry_runs_with_balanced_experts():
    pytest.importorskip("transformers", reason="HF Qwen3-MoE needs transformers")
    r = run_code(HF_MOE, [], DRY)
    assert r["counts"] == [[2 * 32 * 2 // 8] * 8] * 2, r  # 64 tokens x top-2 over 8, 2 layers
    sites = [e for e in r["reads"] if "topk" in e["op"]]
    assert len(sites) == 1 and sites[0]["count"] == 2, r["reads"]
    assert "balanced routing over 8 (2 per row)" in sites[0]["op"]
    assert "modeling_qwen3_moe.py" in sites[0]["at"], sites
    # the experts' loop (one_hot, nonzero, where) ran on real indices: no zero read there
    assert not [e for e in r["reads"] if "nonzero" in e["op"] or "where" in e["op"]], r


GPT_OSS = """\
    import json, torch
    from transformers import GptOssConfig, GptOssForCausalLM
    from neuronlocal.core import dryrun
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                       sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    with torch.device("neuron"):
        model = GptOssForCausalLM(cfg)
""" + EXPERT_COUNTS


def test_hf_gpt_oss_dry_runs_its_grouped_experts_on_real_offsets():
    """GPT-OSS's experts (sort, histc, cumsum offsets into grouped_mm) get the balanced
    routing's offsets: nothing in the experts' path is read as zero."""
    pytest.importorskip("transformers", reason="HF GPT-OSS needs transformers")
    r = run_code(GPT_OSS, [], DRY)
    assert r["counts"] == [[16] * 8] * 2, r
    topk = [e for e in r["reads"] if e["op"].startswith("aten::topk indices")]
    assert len(topk) == 1 and "modeling_gpt_oss.py" in topk[0]["at"], r["reads"]
    assert not [e for e in r["reads"] if "integrations/moe.py" in e["at"]], r["reads"]


def test_cli_refuses_a_bad_routing(tmp_path):
    (tmp_path / "s.py").write_text("print('hi')\n")
    proc = subprocess.run([sys.executable, "-m", "neuronlocal", "run", "--dry-run",
                           "--routing", "hot:1.5", "s.py"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    assert "--routing='hot:1.5' is not a routing policy" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "neuronlocal", "run", "--routing", "hot:0.5",
                           "s.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and "--routing" in proc.stderr, proc.stderr
