"""FlexAttention on neuron (compile/flex.py): eager keeps PyTorch's error; compiled, forward
and backward match the plain computation on CPU with either compiler."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("isolated_compile")]


def _flex_reference(q, k, v):
    """Causal attention with a relative-position bias in plain ops on CPU (PyTorch's own
    FlexAttention refuses CPU backward); kv heads repeated for grouped-query attention."""
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    i = torch.arange(q.size(2))
    bias = (i[:, None] - i[None, :]).float() * 0.1
    scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5 + bias
    return scores.masked_fill(i[:, None] < i[None, :], float("-inf")).softmax(-1) @ v


def test_flex_attention_eager_keeps_pytorch_error():
    """Outside torch.compile FlexAttention does not run on neuron (nor on TorchNeuron)."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 16, 8, device="neuron")
    with pytest.raises(ValueError, match="FlexAttention is only supported on"):
        flex_attention(q, q, q)


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_flex_attention_compiled_fwd_bwd_match_cpu(monkeypatch, compiler):
    """Compiled FlexAttention (score_mod, causal block mask, grouped-query heads) runs on
    neuron, forward and backward, as the plain computation on CPU; the default compiler runs
    its ops through the eager path, and the estimate costs it as attention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torch_neuronx

    monkeypatch.setenv("NEURONLOCAL_COMPILER", compiler)
    torch.manual_seed(0)
    cpu = [torch.randn(1, h, 16, 8, requires_grad=True) for h in (4, 2, 2)]
    dev = [t.detach().to("neuron").requires_grad_() for t in cpu]
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, 16, 16, device="neuron")

    def bias(score, b, h, q, kv):
        return score + (q - kv).to(score.dtype) * 0.1

    torch_neuronx.clear_op_tracking()
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=bias, block_mask=mask,
                                                      enable_gqa=True), backend="neuron")
    out = fn(*dev)
    out.square().sum().backward()
    ref = _flex_reference(*cpu)
    ref.square().sum().backward()
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    for d, c in zip(dev, cpu, strict=True):
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=1e-5, rtol=1e-5)
    (record,) = torch.neuron.get_dynamo_metrics()["graphs"]
    assert record["extra"]["compiler"] == compiler
    if compiler == "eager":
        assert {"aten::bmm", "aten::exp"} <= set(torch_neuronx.get_executed_ops())
    estimate = record["estimate"]
    assert "not_estimated" not in estimate and estimate["backward_tensor_flops"] > 0
    assert estimate["top_nodes"][0]["node"] == "flex_attention"


def test_flex_attention_compiled_under_autocast():
    """Under torch.autocast("neuron", bfloat16) compiled FlexAttention computes in bfloat16
    (as PyTorch's CPU and CUDA autocast kernels of the operator) and its backward runs."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    cpu = [torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3)]
    dev = [t.detach().to("neuron").requires_grad_() for t in cpu]
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, 16, 16, device="neuron")
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=mask,
                                                      score_mod=lambda s, b, h, q, kv: s),
                       backend="neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16):
        out = fn(*dev)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    ref = torch.nn.functional.scaled_dot_product_attention(*cpu, is_causal=True)
    ref.sum().backward()
    torch.testing.assert_close(out.float().cpu(), ref, atol=3e-2, rtol=3e-2)
    for d, c in zip(dev, cpu, strict=True):
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=6e-2, rtol=6e-2)


def test_dense_flex_attention_matches_the_operator_and_masks_rows_safely():
    """Inductor's stand-in for FlexAttention: the operator's output, log-sum-exp and row max;
    a row that masks every key gives zeros, -inf and finite gradients."""
    from torch._higher_order_ops.flex_attention import sdpa_dense
    from torch.nn.attention.flex_attention import create_block_mask

    from neuronlocal.compile.flex import dense_flex_attention

    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    mask = create_block_mask(lambda b, h, i, j: (i >= j) & (i > 0), 2, 2, 8, 8, device="cpu")
    args = (lambda s, b, h, i, j: s * 0.5, mask.as_tuple(), 0.5, {})
    for got, want in zip(dense_flex_attention(q, k, v, *args), sdpa_dense(q, k, v, *args),
                         strict=True):
        torch.testing.assert_close(got, want)
    q.requires_grad_()
    out, lse, _ = dense_flex_attention(q, k, v, *args)
    assert out[:, :, 0].eq(0).all() and lse[:, :, 0].eq(float("-inf")).all()
    (out.sum() + lse[:, :, 1:].sum()).backward()
    assert q.grad.isfinite().all()


def test_selective_checkpointing_around_compiled_flex_attention_matches_cpu():
    """Selective activation checkpointing (torchtitan's default) around a compiled
    FlexAttention, eager outside: the graph compiles with SAC's caching dispatch mode off, as
    Dynamo compiles, so the mode never sees AOTAutograd's trace of the attention backward;
    forward and backward equal plain attention on CPU."""
    import functools

    from torch.nn.attention.flex_attention import flex_attention
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    flex = torch.compile(flex_attention, backend="neuron")

    def block(x, w, attend):
        h = (x @ w).view(1, 2, 16, 8)
        return attend(h, h, h).relu()

    def plain(q, k, v):
        return (q @ k.transpose(-1, -2) / q.size(-1) ** 0.5).softmax(-1) @ v

    torch.manual_seed(0)
    x, w = torch.randn(16, 16), torch.randn(16, 16, requires_grad=True)
    wd = w.detach().to("neuron").requires_grad_()
    out = checkpoint(block, x.to("neuron"), wd, flex, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    out.square().sum().backward()
    ref = block(x, w, plain)
    ref.square().sum().backward()
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wd.grad.cpu(), w.grad, atol=1e-3, rtol=1e-3)


def test_flex_attention_runs_block_by_block_with_true_row_indices(monkeypatch):
    """On neuron the operator attends one block of query rows at a time: with blocks of 3 rows
    (an uneven last block) forward and backward, a captured bias's gradient included, still
    match the plain computation on CPU, and peak HBM stays far under the dense score matrix."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from neuronlocal.compile import flex

    monkeypatch.setattr(flex, "BLOCK_SCORE_BYTES", 1 * 4 * 16 * 4 * 3)  # 3 rows of 16 keys
    torch.manual_seed(0)
    cpu = [torch.randn(1, h, 16, 8, requires_grad=True) for h in (4, 2, 2)]
    head_cpu = torch.randn(4, requires_grad=True)
    dev = [t.detach().to("neuron").requires_grad_() for t in cpu]
    head = head_cpu.detach().to("neuron").requires_grad_()
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, 16, 16, device="neuron")

    def bias(score, b, h, q, kv):
        return score + (q - kv).to(score.dtype) * 0.1 + head[h]

    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=bias, block_mask=mask,
                                                      enable_gqa=True), backend="neuron")
    assert flex.block_rows(dev[0], dev[1]) == 3
    out = fn(*dev)
    out.square().sum().backward()
    q, k, v = cpu
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    i = torch.arange(16)
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5 + (i[:, None] - i[None, :]).float() * 0.1 \
        + head_cpu[None, :, None, None]
    ref = scores.masked_fill(i[:, None] < i[None, :], float("-inf")).softmax(-1) @ v
    ref.square().sum().backward()
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    for d, c in zip([*dev, head], [*cpu, head_cpu], strict=True):
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=1e-5, rtol=1e-5)


def test_flex_attention_memory_grows_with_the_block_not_seq_squared():
    """At 8 heads x 2048 positions one fp32 score matrix is 128 MiB; the blockwise operator's
    whole forward and backward peak stays under two of them (the dense one held several)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2048, 16, device="neuron", requires_grad=True)
               for _ in range(3))
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, 2048, 2048, device="neuron")
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=mask),
                       backend="neuron")
    torch.neuron.reset_peak_memory_stats()
    base = torch.neuron.memory_allocated()
    fn(q, k, v).sum().backward()
    peak = torch.neuron.max_memory_allocated() - base
    assert peak < 2 * 8 * 2048 * 2048 * 4, f"peak {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("window", [None, 64])
def test_flex_attention_skips_the_key_blocks_the_mask_hides(monkeypatch, window):
    """Blocks of query rows attend only the key blocks the block mask lists for them (causal:
    row block i sees key blocks 0..i; a 64-key sliding window: i-1..i, so the keys start past
    0), with the same result and gradients as the plain computation."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from neuronlocal.compile import flex

    def visible(b, h, q, kv):
        return (q >= kv) & (q - kv < window) if window else q >= kv

    monkeypatch.setattr(flex, "BLOCK_SCORE_BYTES", 1 * 4 * 256 * 4 * 64)  # 64 rows
    torch.manual_seed(0)
    cpu = [torch.randn(1, h, 256, 8, requires_grad=True) for h in (4, 2, 2)]
    dev = [t.detach().to("neuron").requires_grad_() for t in cpu]
    mask = create_block_mask(visible, 1, None, 256, 256, device="neuron", BLOCK_SIZE=64)
    blocks = flex._blocks(dev[0], dev[1], mask.as_tuple())
    assert [(x.k0, x.k1) for x in blocks] == (
        [(0, 64), (0, 128), (64, 192), (128, 256)] if window else
        [(0, 64), (0, 128), (0, 192), (0, 256)])
    # mask_mod runs only on the diagonal key blocks (and the window's first); the others
    # are full for every row
    assert [x.masked for x in blocks] == (
        [((0, 64),), ((0, 128),), ((64, 192),), ((128, 256),)] if window else
        [((0, 64),), ((64, 128),), ((128, 192),), ((192, 256),)])

    def bias(score, b, h, q, kv):
        return score + (q - kv).to(score.dtype) * 0.1

    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=bias, block_mask=mask,
                                                      enable_gqa=True), backend="neuron")
    out = fn(*dev)
    out.square().sum().backward()
    q, k, v = cpu
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    i = torch.arange(256)
    hidden = (i[:, None] < i[None, :]) | ((i[:, None] - i[None, :] >= window) if window else False)
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5 + (i[:, None] - i[None, :]).float() * 0.1
    ref = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v
    ref.square().sum().backward()
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    for d, c in zip(dev, cpu, strict=True):
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score", ["identity", "bias"])
def test_blockwise_operator_equals_pytorchs_dense_kernel(monkeypatch, dtype, score):
    """The blockwise kernel against PyTorch's own kernel of the operator (sdpa_dense), with
    rows the mask hides entirely (zeros, -inf), a score_mod or none, fp32 and bf16."""
    from torch._higher_order_ops.flex_attention import sdpa_dense
    from torch.nn.attention.flex_attention import _identity, create_block_mask

    from neuronlocal.compile import flex

    monkeypatch.setattr(flex, "BLOCK_SCORE_BYTES", 2 * 4 * 64 * 4 * 16)  # 16-row blocks
    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 8, dtype=dtype)
    k, v = (torch.randn(2, 2, 64, 8, dtype=dtype) for _ in range(2))
    mask = create_block_mask(lambda b, h, i, j: (i >= j) & (i % 5 != 0), 2, None, 64, 64,
                             device="cpu", BLOCK_SIZE=16).as_tuple()
    mod = _identity if score == "identity" else (
        lambda s, b, h, i, j: s + (i - j).to(s.dtype) * 0.05 + h)
    args = (mod, mask, 8 ** -0.5, {}, (), ())
    got, want = flex.blockwise_flex_attention(q, k, v, *args), sdpa_dense(q, k, v, *args)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2,
                                                                      "rtol": 2e-2}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)
    assert (got[0][:, :, ::5] == 0).all() and (got[1][:, :, ::5] == -float("inf")).all()


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_checkpointed_compiled_flex_attention_trains_the_same_under_the_run_report(ac):
    """The run report's estimate capture is on while the attention graph compiles inside the
    checkpointed region: the estimate's fake run keeps out of checkpointing's saved-tensor
    hooks (it once added saves to the forward and stopped the recompute early), so SAC and
    full AC give the plain computation's outputs and gradients, two SGD steps in a row."""
    import functools

    from torch.nn.attention.flex_attention import flex_attention
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    from neuronlocal.report import collect

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    context = ({"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}
               if ac == "selective" else {})
    flex = torch.compile(flex_attention, backend="neuron")

    def block(x, w, attend):
        h = (x @ w).view(1, 2, 16, 8)
        return attend(h, h, h).relu()

    def plain(q, k, v):
        return (q @ k.transpose(-1, -2) / q.size(-1) ** 0.5).softmax(-1) @ v

    torch.manual_seed(0)
    x, w = torch.randn(16, 16), torch.randn(16, 16, requires_grad=True)
    wd = w.detach().to("neuron").requires_grad_()
    losses, ref_losses = [], []
    c = collect.Collector().start()
    try:
        for _ in range(2):
            loss = checkpoint(block, x.to("neuron"), wd, flex, use_reentrant=False,
                              **context).square().sum()
            loss.backward()
            with torch.no_grad():
                wd -= 1e-3 * wd.grad
            wd.grad = None
            losses.append(loss.item())
    finally:
        c.stop()
    for _ in range(2):
        ref = block(x, w, plain).square().sum()
        ref.backward()
        with torch.no_grad():
            w -= 1e-3 * w.grad
        w.grad = None
        ref_losses.append(ref.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    torch.testing.assert_close(wd.detach().cpu(), w.detach(), atol=1e-4, rtol=1e-4)
    graphs = torch.neuron.get_dynamo_metrics()["graphs"]
    assert graphs and all("not_estimated" not in g["estimate"] for g in graphs)
