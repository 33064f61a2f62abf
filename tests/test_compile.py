"""torch.compile(backend="neuron"): numerics vs CPU, static shapes, cache, failure policy."""

from __future__ import annotations

import collections
import copy
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from neuronlocal import _C

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("isolated_compile")]




@pytest.fixture
def inductor(monkeypatch):
    """Compile with stock Inductor for CPU (NEURONLOCAL_COMPILER=inductor), for tests of
    what only that compiler does (its settings per level, its lowering fixes)."""
    monkeypatch.setenv("NEURONLOCAL_COMPILER", "inductor")


def compiles() -> int:
    return torch.neuron.get_dynamo_metrics()["num_graphs"]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def check_train_step(cpu_model: nn.Module, inputs: tuple, atol: float = 1e-4) -> None:
    """Compiled fwd+bwd on neuron matches eager on CPU (outputs and grads)."""
    dev_model = copy.deepcopy(cpu_model).to("neuron")
    out_c = cpu_model(*inputs)
    out_n = torch.compile(dev_model, backend="neuron")(*(x.to("neuron") for x in inputs))
    assert out_n.device.type == "neuron"
    torch.testing.assert_close(out_n.cpu(), out_c, atol=atol, rtol=1e-4)
    out_c.float().square().mean().backward()
    out_n.float().square().mean().backward()
    for (name, pc), pn in zip(cpu_model.named_parameters(), dev_model.parameters(), strict=True):
        assert pn.grad is not None and pn.grad.device.type == "neuron", name
        torch.testing.assert_close(pn.grad.cpu(), pc.grad, atol=atol, rtol=1e-3, msg=name)


def test_backend_via_entry_point():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("neuron").__name__ == "neuron_backend"


def test_mlp_forward_backward():
    check_train_step(mlp(), (torch.randn(4, 16),))


def test_conv_net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    check_train_step(net, (torch.randn(2, 3, 8, 8),))


def _hf_model(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        model = transformers.GPT2LMHeadModel(cfg)
    return model


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_models(kind):
    ids = torch.randint(0, 128, (2, 16))
    check_train_step(_Logits(_hf_model(kind)), (ids,), atol=2e-4)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_changing_sequence_lengths_default_dynamo_config(kind):
    """A second and third sequence length (Dynamo's automatic dynamic shapes, the default)
    train and match CPU; each concrete shape is one static graph."""
    assert torch._dynamo.config.automatic_dynamic_shapes
    model = _Logits(_hf_model(kind))
    dev = copy.deepcopy(model).to("neuron")
    step = torch.compile(dev, backend="neuron")
    for n in (10, 17, 23):
        ids = torch.randint(0, 128, (2, n))
        model.zero_grad()
        dev.zero_grad()
        out_c, out_n = model(ids), step(ids.to("neuron"))
        torch.testing.assert_close(out_n.cpu(), out_c, atol=2e-4, rtol=1e-4)
        out_c.square().mean().backward()
        out_n.square().mean().backward()
        for (name, pc), pn in zip(model.named_parameters(), dev.parameters(), strict=True):
            torch.testing.assert_close(pn.grad.cpu(), pc.grad, atol=2e-4, rtol=1e-3, msg=name)
    shapes = [g["input_shapes"] for g in torch.neuron.get_dynamo_metrics()["graphs"]]
    seqs = sorted({s[1] for shape in shapes for s in shape if len(s) == 2 and s[0] == 2})
    assert seqs == [10, 17, 23]


def test_static_shapes_warning_points_at_the_users_line(tmp_path, fresh_python):
    """The advice about dynamic shapes names the program's line that compiled, not the
    backend's file."""
    script = tmp_path / "prog.py"
    script.write_text("import warnings, torch\n"
                      "f = torch.compile(lambda x: x * 2, backend='neuron')\n"
                      "with warnings.catch_warnings(record=True) as caught:\n"
                      "    warnings.simplefilter('always')\n"
                      "    for n in (3, 4, 5):\n"
                      "        f(torch.ones(n, device='neuron'))\n"
                      "w, = [w for w in caught if 'static shapes' in str(w.message)]\n"
                      "print(w.filename, w.lineno)\n")
    r = fresh_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(script), "6"]


def test_training_matches_eager_over_steps():
    cpu = mlp()
    dev = copy.deepcopy(cpu).to("neuron")
    step = torch.compile(lambda m, x: m(x).square().mean(), backend="neuron")
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1)
    opt_n = torch.optim.SGD(dev.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(4, 16)
        loss_c = cpu(x).square().mean()
        loss_n = step(dev, x.to("neuron"))
        loss_c.backward()
        loss_n.backward()
        opt_c.step()
        opt_n.step()
        opt_c.zero_grad()
        opt_n.zero_grad()
        torch.testing.assert_close(loss_n.cpu(), loss_c, atol=1e-5, rtol=1e-5)


def test_static_shapes_compile_once_per_shape():
    fn = torch.compile(lambda x: (x * 2).sum(-1), backend="neuron")
    x = torch.randn(4, 8, device="neuron")
    fn(x)
    fn(x + 1)
    assert compiles() == 1
    fn(torch.randn(4, 9, device="neuron"))
    assert compiles() == 2
    for n in (10, 11, 10):
        out = fn(torch.ones(4, n, device="neuron"))
        assert out.device.type == "neuron" and out[0].item() == 2 * n
    assert compiles() == 4  # 10 and 11 are new; 10 again is not
    kinds = {g["kind"] for g in torch.neuron.get_dynamo_metrics()["graphs"]}
    assert kinds <= {"static", "specialized"}


# -O1's C++ wrapper compile takes about 20 s: the mechanism is the same at level 2.
@pytest.mark.parametrize("flags", [pytest.param("-O1", marks=pytest.mark.slow), "--optlevel 2"])
def test_optimisation_level_sets_inductor_config(monkeypatch, inductor, flags):
    """NEURON_CC_FLAGS's level picks Inductor's settings (-O1: one C++ file per graph, scalar
    loops, no C++ optimisation); the graph matches CPU forward and backward either way, and
    the caller's own patches win over the level's."""
    from neuronlocal.compile import static
    from neuronlocal.compile.lowering import OPTLEVEL_PATCHES

    seen: list[dict] = []
    stock = static.stock_compile_fx()

    def recording(gm, examples, config_patches=None):
        seen.append(dict(config_patches or {}))
        return stock(gm, examples, config_patches=config_patches)

    monkeypatch.setattr(static, "stock_compile_fx", lambda: recording)
    monkeypatch.setenv("NEURON_CC_FLAGS", flags)
    check_train_step(mlp(), (torch.randn(4, 16),))
    level = 1 if flags == "-O1" else 2
    assert seen == [OPTLEVEL_PATCHES[level]], seen
    assert OPTLEVEL_PATCHES[1]["cpp_wrapper"] is True and OPTLEVEL_PATCHES[2] == {}
    torch._dynamo.reset()
    torch.compile(mlp().to("neuron"), backend="neuron",
                  options={"config_patches": {"cpp_wrapper": False}})(
        torch.randn(4, 16, device="neuron"))
    assert seen[-1] == {**OPTLEVEL_PATCHES[level], "cpp_wrapper": False}


@pytest.mark.parametrize(("pool", "shape"), [
    (nn.AvgPool1d(2, ceil_mode=True), (1, 2, 5)),
    (nn.AvgPool2d(3, ceil_mode=True), (2, 3, 7, 5)),
    (nn.AvgPool2d(320, ceil_mode=True), (1, 4, 2, 2)),  # EfficientNet's head on a tiny map
    (nn.AvgPool3d(3, ceil_mode=True), (1, 2, 4, 4, 4)),
], ids=["1d", "2d", "2d-kernel-over-input", "3d"])
def test_average_pool_with_ceil_mode_has_eager_gradients(inductor, pool, shape):
    """Inductor's own average-pool backward divides a last window that overhangs the input by
    the whole kernel (EfficientNet's head, Funnel's pooling); neuron graphs get eager's."""
    torch.manual_seed(0)
    x = torch.randn(shape)
    ref = x.clone().requires_grad_()
    pool(ref).square().sum().backward()
    dev = x.to("neuron").requires_grad_()
    torch.compile(pool, backend="neuron")(dev).square().sum().backward()
    torch.testing.assert_close(dev.grad.cpu(), ref.grad)


def test_default_backend_on_neuron_matches_cpu():
    """torch.compile(model) with no backend (Inductor) on neuron tensors compiles through the
    neuron backend and matches CPU, forward and backward."""
    cpu = mlp()
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(4, 16)
    out_n = torch.compile(dev)(x.to("neuron"))
    out_c = cpu(x)
    torch.testing.assert_close(out_n.cpu(), out_c)
    out_n.square().sum().backward()
    out_c.square().sum().backward()
    for pc, pn in zip(cpu.parameters(), dev.parameters(), strict=True):
        assert pn.grad.device.type == "neuron"
        torch.testing.assert_close(pn.grad.cpu(), pc.grad)
    assert compiles() == 1


def test_default_backend_leaves_cpu_graphs_to_inductor():
    fn = torch.compile(lambda x: torch.sin(x) * 2)
    out = fn(torch.ones(3))
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, torch.sin(torch.ones(3)) * 2)
    assert compiles() == 0


def test_output_moved_to_cpu_stays_on_cpu():
    out = torch.compile(lambda a: (a + 1).cpu(), backend="neuron")(torch.ones(2, device="neuron"))
    assert out.device.type == "cpu" and out.tolist() == [2.0, 2.0]


def test_dynamo_device_interface():
    from torch._dynamo.device_interface import get_interface_for_device

    iface = get_interface_for_device("neuron")
    assert iface.device_count() == torch.neuron.device_count()
    assert iface.current_device() == torch.neuron.current_device()
    assert iface.is_available()


def test_mark_dynamic_specializes_with_one_warning(monkeypatch):
    from neuronlocal.compile import backend

    monkeypatch.setattr(backend, "_warned", set())
    fn = torch.compile(lambda x: x.softmax(-1) * 2, backend="neuron")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in (8, 12, 16):
            x = torch.randn(2, n, device="neuron")
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(fn(x).cpu(), x.cpu().softmax(-1) * 2)
    graphs = torch.neuron.get_dynamo_metrics()["graphs"]
    assert [g["kind"] for g in graphs] == ["specialized"] * 3
    assert len([w for w in seen if "once per concrete shape" in str(w.message)]) == 1


def test_compiled_graph_memory_is_counted():
    """A compiled graph's buffers count against the core, as device memory on Trainium: the
    activations a compiled forward saves for backward are live HBM until backward frees
    them, and everything returns to the baseline after the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).to("neuron")
    x = torch.randn(512, 256, device="neuron")
    step = torch.compile(lambda m, x: m(x).square().mean(), backend="neuron")
    step(model, x).backward()
    model.zero_grad(set_to_none=True)
    base = torch.neuron.memory_allocated()
    torch.neuron.reset_peak_memory_stats()
    loss = step(model, x)
    saved = torch.neuron.memory_allocated() - base
    loss.backward()
    del loss
    activation = 512 * 1024 * 4  # the ReLU output, saved for backward
    assert saved >= activation
    assert torch.neuron.max_memory_allocated() - base >= activation
    model.zero_grad(set_to_none=True)
    assert torch.neuron.memory_allocated() == base


def test_inductor_bridge_crosses_once_each_way(monkeypatch, inductor):
    """With Inductor, a compiled call crosses the bridge in one C++ call each way, however
    many inputs it has (which inputs become leaves is fixed at compile time, as Dynamo guards
    on it), and its results match eager CPU: a CPU input that requires grad, a view output,
    an integer output and an output moved to the CPU, forward and backward; without grad the
    same graph takes one call each way too."""
    from neuronlocal.compile import bridge

    monkeypatch.setenv("NEURON_CC_FLAGS", "-O1")  # one C++ file per graph: a quick build
    calls: collections.Counter = collections.Counter()

    class Counted:
        def __getattr__(self, name: str):
            fn = getattr(_C, name)
            if not name.startswith("_bridge"):
                return fn

            def counted(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return counted

    monkeypatch.setattr(bridge, "_C", Counted())
    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), torch.randn(4, 8)

    def f(m, x, s):
        y = m(x) * s
        return y.sum(), y.argmax(-1), y.t(), y.mean(0).cpu()

    def step(dev: str, fn, m, s) -> list[torch.Tensor]:
        loss, idx, yt, host = fn(m, x.to(dev), s)
        assert host.device.type == "cpu" and idx.device.type == dev
        (loss + yt[0].sum() + host.sum().to(dev)).backward()
        grads = [p.grad.cpu() for p in m.parameters()]
        return [loss.cpu(), idx.cpu(), yt.cpu(), host, s.grad, *grads]

    want = step("cpu", f, copy.deepcopy(model), torch.tensor(2.0, requires_grad=True))
    m, fn = copy.deepcopy(model).to("neuron"), torch.compile(f, backend="neuron")
    for _ in range(2):
        calls.clear()
        m.zero_grad(set_to_none=True)
        got = step("neuron", fn, m, torch.tensor(2.0, requires_grad=True))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    assert calls == {"_bridge_in": 2, "_bridge_out": 2}  # a forward and its backward
    with torch.no_grad():
        fn(m, x.to("neuron"), torch.tensor(2.0))
        calls.clear()
        loss, *_ = fn(m, x.to("neuron"), torch.tensor(2.0))
    assert calls == {"_bridge_in": 1, "_bridge_out": 1} and not loss.requires_grad
    torch.testing.assert_close(loss.cpu(), want[0])


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_inductor_loads_with_dynamo_only_for_the_inductor_compiler(compiler):
    """NEURONLOCAL_COMPILER=inductor loads Inductor's compiler with Dynamo, as stock Inductor
    loads it at torch.compile, so the first compiled call does not import it; the default
    compiler never loads it."""
    code = ("import sys, torch, torch._dynamo; "
            "print('torch._inductor.compile_fx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "NEURONLOCAL_COMPILER": compiler})
    assert out.stdout.split() == [str(compiler == "inductor")]


def test_a_parameter_freed_and_gathered_again_before_backward():
    """FSDP2's pattern: after forward the unsharded parameter's storage is freed (resize to
    0), other tensors take the memory, and before backward the storage is allocated again
    and the parameter gathered into it. The compiled graph's saved parameter must read the
    new bytes, as a saved view of one storage does on CPU."""
    torch.manual_seed(0)
    w, x = torch.randn(8, 8), torch.randn(4, 8)

    def run(dev: str, backend: str) -> list[torch.Tensor]:
        p = nn.Parameter(w.clone().to(dev))
        xx = x.to(dev).requires_grad_(True)
        y = torch.compile(lambda a, b: torch.tanh(a @ b).sum(), backend=backend)(xx, p)
        nbytes = p.untyped_storage().nbytes()
        p.untyped_storage().resize_(0)
        taken = torch.full((8, 8), 7.0, device=dev)  # noqa: F841 - holds the freed memory
        p.untyped_storage().resize_(nbytes)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
            p.copy_(w)
        y.backward()
        return [xx.grad.cpu(), p.grad.cpu()]

    for got, want in zip(run("neuron", "neuron"), run("cpu", "inductor"), strict=True):
        torch.testing.assert_close(got, want)


def test_default_compiler_builds_no_code(monkeypatch):
    """The default compiler runs AOTAutograd's forward and backward graphs on neuron through
    the eager path: no Inductor compile, the ops tracked as eager ops are, one record with its
    parts, and a DTensor-like subclass desugared by the same AOTAutograd call."""
    from torch.testing._internal.two_tensor import TwoTensor

    from neuronlocal.compile import static

    def no_inductor():
        raise AssertionError("the default compiler must not call Inductor")

    monkeypatch.setattr(static, "stock_compile_fx", no_inductor)
    import torch_neuronx

    torch_neuronx.clear_op_tracking()
    check_train_step(mlp(), (torch.randn(4, 16),))
    graph, = torch.neuron.get_dynamo_metrics()["graphs"]
    assert graph["extra"]["compiler"] == "eager" and graph["cache"] == "miss"
    assert set(graph["extra"]["parts"]) == {"forward", "backward"}
    assert "aten::addmm" in torch_neuronx.get_executed_ops()
    torch._dynamo.reset()
    a, w = TwoTensor(torch.randn(4, 8), torch.randn(4, 8)), torch.randn(8, 3)
    x = TwoTensor(a.a.to("neuron"), a.b.to("neuron")).requires_grad_()
    torch.compile(lambda x, w: (x @ w).relu().sum(), backend="neuron")(
        x, w.to("neuron")).backward()
    assert isinstance(x.grad, TwoTensor) and x.grad.a.device.type == "neuron"
    ref = a.clone().requires_grad_()
    (ref @ w).relu().sum().backward()
    torch.testing.assert_close(x.grad.a.cpu(), ref.grad.a)


@pytest.mark.parametrize("device,compiler", [("neuron", "eager"), ("neuron", "inductor"),
                                             ("cpu", "eager")])
def test_compiled_dropout_draws_what_eager_draws(monkeypatch, device, compiler):
    """After manual_seed, a compiled dropout keeps exactly the elements eager keeps (the
    default compiler draws from CPU's global generator, as TorchNeuron's compiled graphs take
    their masks from CPU's native_dropout; Inductor's graphs, which CPU inputs get too, run
    ATen's random kernels instead of Inductor's own random numbers)."""
    monkeypatch.setenv("NEURONLOCAL_COMPILER", compiler)
    x = torch.ones(4096, device=device, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x * 3, 0.3, training=True)

    torch.manual_seed(7)
    want = f(x)
    want.sum().backward()
    want_grad, x.grad = x.grad.clone(), None
    torch.manual_seed(7)
    got = torch.compile(f, backend="neuron")(x)
    got.sum().backward()
    assert torch.equal(got.cpu(), want.cpu()) and torch.equal(x.grad.cpu(), want_grad.cpu())


def test_checkpointed_dropout_replays_its_mask_in_backward():
    """Activation checkpointing with dropout inside, compiled: AOTAutograd's RNG wrappers
    save CPU's generator state (which random ops on neuron draw from) in forward and replay
    it in backward, so loss and gradients are eager's exactly (TRL trains with checkpointing
    on by default)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = nn.Linear(16, 16).to("neuron")

    def f(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda y: nn.functional.dropout(lin(y), 0.5, training=True).relu(),
                          x, use_reentrant=False).sum()

    x = torch.randn(8, 16, device="neuron", requires_grad=True)
    torch.manual_seed(1)
    want = f(x)
    want.backward()
    want_grad, x.grad = x.grad.clone(), None
    torch.manual_seed(1)
    got = torch.compile(f, backend="neuron")(x)
    got.backward()
    assert torch.equal(got.cpu(), want.cpu()) and torch.equal(x.grad.cpu(), want_grad.cpu())


def test_dynamic_true_rejected():
    fn = torch.compile(lambda x: x + 1, backend="neuron", dynamic=True)
    with pytest.raises(Exception, match=r"dynamic=True\) is not supported"):
        fn(torch.randn(3, device="neuron"))


def test_mode_warns_and_acts_as_default():
    fn = torch.compile(lambda x: x.relu(), backend="neuron", mode="max-autotune")
    with pytest.warns(UserWarning, match="max-autotune"):
        out = fn(torch.randn(5, device="neuron"))
    assert out.device.type == "neuron"


def test_graph_break_fullgraph_false():
    def f(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    x = torch.randn(6, device="neuron")
    out = torch.compile(f, backend="neuron")(x)
    torch.testing.assert_close(out.cpu(), x.cpu().sin().cos())
    m = torch.neuron.get_dynamo_metrics()
    assert m["num_graphs"] == 2
    assert m["graph_breaks"], "graph break reasons are recorded"
    torch._dynamo.reset()  # the cached frames would satisfy the fullgraph call without tracing
    with pytest.raises(Exception, match="graph_break|graph break|Unsupported"):
        torch.compile(f, backend="neuron", fullgraph=True)(x)


def test_cpu_inputs_are_copied(monkeypatch):
    """A graph compiled for neuron takes CPU inputs and returns neuron outputs, as
    TorchNeuron copies CPU inputs to the device; RETAIN_DEVICE_MODE keeps them on CPU."""
    fn = torch.compile(lambda x, y: x + y, backend="neuron")
    out = fn(torch.ones(3), torch.ones(3))
    assert out.device.type == "neuron" and out.sum().item() == 6
    torch._dynamo.reset()
    monkeypatch.setenv("TORCH_NEURONX_RETAIN_DEVICE_MODE", "1")
    out = torch.compile(lambda x, y: x * y, backend="neuron")(torch.ones(3), torch.ones(3))
    assert out.device.type == "cpu" and out.sum().item() == 3
    monkeypatch.delenv("TORCH_NEURONX_RETAIN_DEVICE_MODE")
    torch._dynamo.reset()
    monkeypatch.setenv("TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY", "1")
    with pytest.raises(Exception, match="DISABLE_CPU_AUTOCOPY"):
        torch.compile(lambda x, y: x - y, backend="neuron")(torch.ones(3), torch.ones(3))


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_failure_policy(monkeypatch, compiler):
    from torch._inductor import lowering

    from neuronlocal.compile import static

    def boom(*args, **kwargs):
        raise RuntimeError("injected codegen failure")

    monkeypatch.setenv("NEURONLOCAL_COMPILER", compiler)
    if compiler == "inductor":
        monkeypatch.setitem(lowering.lowerings, torch.ops.aten.cosh.default, boom)
    else:
        monkeypatch.setattr(static, "compile_parts", boom)
    f = torch.compile(lambda x: torch.cosh(x) + 1, backend="neuron")
    with pytest.raises(Exception, match="could not compile graph") as info:
        f(torch.randn(3, device="neuron"))
    assert "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION" in str(info.value)
    torch._dynamo.reset()
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "0")
    x = torch.randn(3, device="neuron")
    with pytest.warns(UserWarning, match="running it eagerly"):
        out = torch.compile(lambda x: torch.cosh(x) + 1, backend="neuron")(x)
    torch.testing.assert_close(out.cpu(), torch.cosh(x.cpu()) + 1)


def test_dropout_in_compiled_graph():
    drop = torch.compile(lambda x: nn.functional.dropout(x, 0.5, training=True), backend="neuron")
    out = drop(torch.ones(20000, device="neuron")).cpu()
    kept = (out != 0).float().mean().item()
    assert 0.47 < kept < 0.53
    assert set(out.unique().tolist()) <= {0.0, 2.0}


def test_metrics_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "neff"))
    x = torch.randn(4, 4, device="neuron")
    torch.compile(lambda x: x @ x - 0.375, backend="neuron")(x)  # a new graph, an empty cache
    torch.compile(lambda x: x @ x - 0.375, backend="neuron")(x)  # the same graph again
    graphs = torch.neuron.get_dynamo_metrics()["graphs"]
    for k in ("graph_id", "graph_name", "node_count", "input_shapes", "compile_seconds", "cache",
              "has_collectives"):
        assert k in graphs[0]
    assert [g["input_shapes"] for g in graphs] == [[(4, 4)], [(4, 4)]]
    assert [g["cache"] for g in graphs] == ["miss", "hit"]
    assert graphs[0]["has_collectives"] is False
    torch.neuron.reset_dynamo_metrics()
    assert compiles() == 0


def test_recompile_reason_recorded():
    fn = torch.compile(lambda x, n: x * n, backend="neuron")
    x = torch.randn(3, device="neuron")
    fn(x, 2)
    fn(x, 3)
    reasons = torch.neuron.get_dynamo_metrics()["recompiles"]
    # Dynamo's failed guard on the int argument, with the value it was compiled for.
    assert len(reasons) == 1
    assert re.search(r"\bn == 2\b", reasons[0]["reason"]), reasons[0]["reason"]


def test_bucketing():
    from neuronlocal.compile.bucketing import pad_to_bucket, suggest_buckets

    ids = torch.ones(2, 13, dtype=torch.long)
    padded, mask = pad_to_bucket(ids, [8, 16, 32])
    assert padded.shape == (2, 16) and mask.sum().item() == 26
    with pytest.raises(ValueError, match="largest bucket"):
        pad_to_bucket(torch.ones(1, 40, dtype=torch.long), [8, 16, 32])
    assert suggest_buckets([5, 9, 17]) == [8, 16, 24]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn = torch.compile(lambda i, m: (i * m).sum(), backend="neuron")
        for n in (3, 5, 7, 9, 11):
            fn(*(t.to("neuron") for t in pad_to_bucket(torch.ones(1, n, dtype=torch.long),
                                                        [8, 16])))
    assert compiles() == 2


@pytest.mark.parametrize("flags", ["", "-O1"])
def test_tensor_subclass_inputs_are_desugared(monkeypatch, inductor, flags):
    """A traceable wrapper subclass (TwoTensor here, DTensor in tensor parallelism) goes
    through AOTAutograd first: outputs and gradients come back as the subclass, on neuron,
    matching CPU eager, at either optimisation level (-O1 builds one C++ file per graph from
    the graph's own input descriptions)."""
    from torch.testing._internal.two_tensor import TwoTensor

    monkeypatch.setenv("NEURON_CC_FLAGS", flags)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.sin(x) @ w).relu().sum(dim=0)

    torch.manual_seed(0)
    a, b, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 3)
    ref_x, ref_w = TwoTensor(a.clone(), b.clone()).requires_grad_(), w.clone().requires_grad_()
    ref = f(ref_x, ref_w)
    ref.sum().backward()
    x = TwoTensor(a.to("neuron"), b.to("neuron")).requires_grad_()
    nw = w.to("neuron").requires_grad_()
    compiled = torch.compile(f, backend="neuron")
    out = compiled(x, nw)
    out.sum().backward()
    assert isinstance(out, TwoTensor) and out.a.device.type == "neuron"
    assert isinstance(x.grad, TwoTensor) and x.grad.a.device.type == "neuron"
    assert nw.grad.device.type == "neuron"
    for got, want in ((out, ref), (x.grad, ref_x.grad), (nw.grad, ref_w.grad)):
        torch.testing.assert_close(got.a.cpu(), want.a)
        torch.testing.assert_close(got.b.cpu(), want.b)
    parts = [g["extra"].get("part") for g in torch.neuron.get_dynamo_metrics()["graphs"]]
    assert parts == ["forward", "backward"]
    # Without grad: AOTAutograd's inference graph. (Fresh inputs: Dynamo itself fails to
    # recompile for a TwoTensor it has already traced, on CPU too.)
    with torch.no_grad():
        fresh = TwoTensor(x.a.detach(), x.b.detach())
        torch.testing.assert_close(compiled(fresh, nw.detach()).a.cpu(), ref.a.detach())
    assert torch.neuron.get_dynamo_metrics()["graphs"][-1]["extra"]["part"] == "inference"


def test_compiled_backward_takes_a_kernel_layout_the_trace_did_not_predict():
    """softplus_backward on CPU keeps its gradient's transposed layout where the traced
    strides say contiguous; the view that follows must still run (as hybrid-attention
    models' gates need at a new sequence length)."""
    w = torch.randn(2, 4, 7)

    def f(a):
        y = torch.nn.functional.softplus(a.view(2, 7, 4))
        return (y.transpose(1, 2) * w.to(a.device)).sum()

    cpu = torch.randn(14, 4, requires_grad=True)
    dev = cpu.detach().to("neuron").requires_grad_()
    torch.compile(f, backend="neuron")(dev).backward()
    f(cpu).backward()
    torch.testing.assert_close(dev.grad.cpu(), cpu.grad)


def test_an_inference_graph_updates_its_input_in_place():
    """A static-cache update (`cache.index_copy_`) runs in place in the compiled graph, as
    Trainium aliases the output to the input: no second buffer the cache's size is live
    during the call, and the values are eager's."""
    cache = torch.zeros(64, 4096, device="neuron")  # 1 MiB
    idx = torch.tensor([3], device="neuron")

    def step(cache, idx, new):
        cache.index_copy_(0, idx, new)
        return cache[:8].sum(dim=0)

    compiled = torch.compile(step, backend="neuron")
    with torch.no_grad():
        compiled(cache, idx, torch.ones(1, 4096, device="neuron"))  # compile
        base = torch.neuron.memory_allocated()
        torch.neuron.reset_peak_memory_stats()
        out = compiled(cache, idx, torch.full((1, 4096), 2.0, device="neuron"))
    assert torch.neuron.max_memory_allocated() - base < cache.numel() * 4 // 2
    ref = torch.zeros(64, 4096)
    ref[3] = 2.0
    torch.testing.assert_close(cache.cpu(), ref)
    torch.testing.assert_close(out.cpu(), ref[:8].sum(dim=0))


@pytest.mark.parametrize("case", ["read-after", "view-before", "returned"])
def test_input_updates_stay_functional_where_in_place_would_change_the_result(case):
    """Where an op on the input is read afterwards, a view of the input exists, or the
    updated value is an output, the graph keeps its copy: results equal eager's."""
    def read_after(buf, src):
        old = buf * 1.0
        buf.add_(src)
        return old + buf

    def view_before(buf, src):
        head = buf[:2]
        buf.add_(src)
        return head * 3

    def returned(buf, src):
        return buf.add_(src)

    fn = {"read-after": read_after, "view-before": view_before, "returned": returned}[case]
    cpu_buf, src = torch.arange(8.0).reshape(4, 2), torch.ones(4, 2)
    dev_buf = cpu_buf.to("neuron")
    with torch.no_grad():
        ref = fn(cpu_buf, src).clone()
        got = torch.compile(fn, backend="neuron")(dev_buf, src.to("neuron"))
    torch.testing.assert_close(got.cpu(), ref)
    torch.testing.assert_close(dev_buf.cpu(), cpu_buf)


def test_a_view_keeps_the_traced_strides_of_its_size_one_dims():
    """A diffusers attention block: the reshape back to (1, C, H, W) after a transposed
    projection gives the batch-1 dim another stride at run time than in the trace, which
    therefore left out group norm's `contiguous()`; CPU's group norm checks the layout."""
    gn = nn.GroupNorm(8, 64)

    def block(x, gn):
        b, c, h, w = x.shape
        y = x.view(b, c, h * w).transpose(1, 2)
        y = nn.functional.linear(y, torch.eye(64, device=x.device))
        y = y.transpose(-1, -2).reshape(b, c, h, w)
        return gn((y + x) / 1.0)

    x = torch.randn(1, 64, 8, 8)
    with torch.no_grad():
        ref = block(x, gn)
        out = torch.compile(block, backend="neuron")(x.to("neuron"), copy.deepcopy(gn).to("neuron"))
    torch.testing.assert_close(out.cpu(), ref)


def test_dispatch_modes_around_the_first_call_never_see_the_compile():
    """A graph compiles at its first call as Dynamo compiles, with the ambient dispatch modes
    off: a TorchDispatchMode around the call (SAC's caching mode, FlopCounterMode) sees the
    same real ops on the first call as on the next, never AOTAutograd's fake tracing."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls):  # as SAC's modes: Dynamo compiles under it
            return True

        def __init__(self):
            super().__init__()
            self.fakes = 0
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            self.fakes += any(isinstance(a, FakeTensor) for a in leaves)
            self.ops += 1
            return func(*args, **(kwargs or {}))

    fn = torch.compile(lambda x, w: (x @ w).relu().sum(), backend="neuron")
    x = torch.randn(4, 8, device="neuron")
    w = torch.randn(8, 8, device="neuron", requires_grad=True)
    counts = []
    for _ in range(2):
        with Seen() as seen:
            fn(x, w).backward()
        counts.append(seen.ops)
        assert seen.fakes == 0
    assert counts[0] == counts[1]
