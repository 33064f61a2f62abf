"""Eager mode on `neuron`: every result is compared with plain CPU PyTorch.

Covers views, in-place, out=, factories, copies between devices and cores, serialization,
storages, the same-device rule, autograd, autocast, per-core RNG, Trainium's 64-bit
numerics policy, op tracking, strict mode and the errors for bad input.
"""

from __future__ import annotations

import copy
import io
import json
import pickle
import warnings

import pytest
import torch

import neuronlocal
import neuronlocal.eager
import torch_neuronx
from neuronlocal.eager import ops

SAME_DEVICE = "Expected all tensors to be on the same device, but found at least two devices"


@pytest.fixture
def policy():
    """Restores the eager policy a test changes with neuronlocal.eager.set_policy."""
    cfg = neuronlocal.config
    yield neuronlocal.eager.set_policy
    neuronlocal.eager.set_policy(strict=cfg.strict, downcast_64bit=cfg.downcast_64bit)


# ---- views and in-place ------------------------------------------------------------------------


def test_views_share_storage_and_track_base():
    cpu = torch.arange(24.0).view(4, 6)
    x = cpu.to("neuron:1")
    ops = {
        "view": lambda t: t.view(6, 4), "slice": lambda t: t[1:3, ::2], "t": lambda t: t.t(),
        "diagonal": lambda t: t.diagonal(), "select": lambda t: t[2],
        "narrow": lambda t: t.narrow(1, 2, 3), "expand": lambda t: t[:1].expand(3, 6),
        "unfold": lambda t: t.unfold(1, 2, 2), "permute": lambda t: t.permute(1, 0),
        "as_strided": lambda t: t.as_strided((2, 2), (6, 1), 1),
        "unsqueeze": lambda t: t.unsqueeze(0), "flatten": lambda t: t.flatten(),
    }
    for name, op in ops.items():
        v = op(x)
        assert v._is_view() and v._base is x, name
        assert v.device == torch.device("neuron:1"), name
        assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), name
        assert v.storage_offset() == op(cpu).storage_offset(), name
        assert v.stride() == op(cpu).stride(), name
        torch.testing.assert_close(v.cpu(), op(cpu), rtol=0, atol=0, msg=name)
    # writes through a view reach the base, and the other way round
    row = x[1]
    row.add_(100)
    x[:, 0].fill_(-1)
    cpu_ref = cpu.clone()
    cpu_ref[1].add_(100)
    cpu_ref[:, 0].fill_(-1)
    assert torch.equal(x.cpu(), cpu_ref) and torch.equal(row.cpu(), cpu_ref[1])
    assert row._version == x._version  # one version counter, so autograd sees view writes


def test_inplace_keeps_identity_and_storage():
    x = torch.ones(5, device="neuron:2")
    ptr = x.data_ptr()
    r = x.add_(2).mul_(3).clamp_(max=8.5)
    assert r is x and x.data_ptr() == ptr
    torch.testing.assert_close(x.cpu(), torch.full((5,), 8.5))
    x.zero_()
    assert x.data_ptr() == ptr and x.abs().sum().item() == 0


def _view_inplace_autograd(dev: str):
    torch.manual_seed(0)
    w = torch.randn(3, 4)
    leaf = w.to(dev).requires_grad_()
    c = leaf.clone()
    c[:, 1].mul_(3)  # in-place on views of the clone of a leaf
    c[0].add_(c[1].detach()).pow_(2)
    c.t()[3].sin_()
    b = c[2]
    c.mul_(2)  # in-place on the base after the view was taken: the view sees it
    weights = torch.arange(12.0, device=dev).view(3, 4)
    ((c * weights).sum() + b.pow(2).sum()).backward()
    return c.detach().cpu(), b.detach().cpu(), leaf.grad.cpu(), c.grad_fn.name(), b.grad_fn.name()


def test_inplace_on_view_of_leaf_clone_updates_grads():
    got, want = _view_inplace_autograd("neuron"), _view_inplace_autograd("cpu")
    for g, w in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(g, w)
    assert got[3:] == want[3:]  # same autograd graph (CopySlices / AsStridedBackward...)
    leaf = torch.randn(3, device="neuron", requires_grad=True)
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
        leaf[0].mul_(2)


# ---- out= --------------------------------------------------------------------------------------


def test_out_variants_resize_and_return_the_out_tensor():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    out = torch.empty(0, device="neuron")
    r = torch.mm(a.to("neuron"), b.to("neuron"), out=out)
    assert r is out and out.shape == (3, 5) and out.device == torch.device("neuron:0")
    torch.testing.assert_close(out.cpu(), a @ b)
    ptr = out.data_ptr()
    torch.mm(a.to("neuron"), b.to("neuron"), out=out)  # right size: written in place
    assert out.data_ptr() == ptr
    small = torch.empty(2, device="neuron:1")
    with pytest.warns(UserWarning, match="An output with one or more elements was resized"):
        torch.add(torch.ones(3, 3, device="neuron:1"), 1, out=small)
    assert small.shape == (3, 3) and torch.equal(small.cpu(), torch.full((3, 3), 2.0))
    vals = torch.empty(0, device="neuron")
    idx = torch.empty(0, dtype=torch.long, device="neuron")
    m = torch.tensor([[1.0, 5.0], [7.0, 2.0]])
    rv, ri = torch.max(m.to("neuron"), 1, out=(vals, idx))
    assert rv is vals and ri is idx
    assert torch.equal(vals.cpu(), torch.tensor([5.0, 7.0]))
    assert torch.equal(idx.cpu(), torch.tensor([1, 0]))
    # a 64-bit out= keeps its dtype although it was computed in 32 bits
    d = torch.arange(12, dtype=torch.float64).view(3, 4)
    o64 = torch.empty(0, dtype=torch.float64, device="neuron")
    torch.sum(d.to("neuron"), 1, out=o64)
    assert o64.dtype == torch.float64 and o64.shape == (3,)
    torch.testing.assert_close(o64.cpu(), d.sum(1))
    # errors are CPU's
    with pytest.raises(RuntimeError, match="Expected out tensor to have dtype float, but got int"):
        torch.mm(a.to("neuron"), b.to("neuron"), out=torch.empty(0, dtype=torch.int32,
                                                                 device="neuron"))
    with pytest.raises(RuntimeError, match=SAME_DEVICE + ", neuron:0 and neuron:1"):
        torch.add(torch.ones(3, device="neuron"), 1, out=torch.empty(3, device="neuron:1"))
    with pytest.raises(RuntimeError, match=SAME_DEVICE + ", neuron:0 and cpu"):
        torch.add(torch.ones(3, device="neuron"), 1, out=torch.empty(3))


# ---- factories and copies ----------------------------------------------------------------------


def test_factories_on_a_given_core():
    factories = {
        "zeros": lambda d: torch.zeros(2, 3, device=d),
        "ones": lambda d: torch.ones(4, dtype=torch.int32, device=d),
        "full": lambda d: torch.full((2,), 3.5, device=d),
        "arange": lambda d: torch.arange(2, 11, 3, device=d),
        "linspace": lambda d: torch.linspace(0, 1, 5, device=d),
        "eye": lambda d: torch.eye(3, device=d),
        "tensor": lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
        "empty_strided": lambda d: torch.empty_strided((2, 3), (1, 2), device=d).fill_(1),
        "tril_indices": lambda d: torch.tril_indices(3, 3, device=d),
    }
    for i in range(4):
        for name, make in factories.items():
            got, want = make(f"neuron:{i}"), make("cpu")
            assert got.device == torch.device("neuron", i), name
            assert got.dtype == want.dtype and got.stride() == want.stride(), name
            assert torch.equal(got.cpu(), want), name
    x = torch.ones(3, device="neuron:2")
    for like in (torch.zeros_like(x), torch.full_like(x, 7), x.new_zeros(4), x.new_tensor([1.0]),
                 torch.empty_like(x), torch.rand_like(x)):
        assert like.device == torch.device("neuron:2")
    assert torch.neuron.current_device() == 0  # creating on neuron:2 did not switch cores
    with torch.neuron.device(3):
        assert torch.zeros(1, device="neuron").device == torch.device("neuron:3")


def test_copies_between_cpu_and_cores():
    src = torch.randn(4, 6)
    a = src.to("neuron")
    b = a.to("neuron:1")
    c = b.to(torch.device("neuron", 3))
    assert (a.device.index, b.device.index, c.device.index) == (0, 1, 3)
    assert b.data_ptr() != a.data_ptr()
    for t in (a, b, c):
        assert torch.equal(t.cpu(), src)
    dst = torch.empty(4, 6, device="neuron:2")
    with pytest.raises(RuntimeError, match="requires tensors on same Neuron core"):
        dst.copy_(b)  # TorchNeuron copies between cores only by moving: .to(device)
    dst.copy_(b.to(dst.device))
    assert torch.equal(dst.cpu(), src) and dst.device.index == 2
    noncontig = src.t()  # 6x4, strided
    d1 = torch.empty(6, 4, device="neuron:1").copy_(noncontig)
    assert torch.equal(d1.cpu(), noncontig)
    back = torch.empty(4, 6)
    back.copy_(c.t().contiguous().t())
    assert torch.equal(back.t(), src.t())
    half = src.to("neuron:1", torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half.cpu(), src.half())
    assert torch.equal(src.to("neuron:3", non_blocking=True).cpu(), src)
    assert torch.equal(b.to("cpu", torch.float64), src.double())


def test_item_and_tolist():
    assert torch.tensor(3.5, device="neuron").item() == 3.5
    assert torch.tensor(2**40 + 1, device="neuron:1").item() == 2**40 + 1  # exact: no compute
    assert torch.tensor(0.1, dtype=torch.float64, device="neuron:3").item() == 0.1
    assert torch.tensor(True, device="neuron").item() is True
    assert torch.arange(4, device="neuron:2").sum().item() == 6
    assert torch.arange(3, device="neuron").tolist() == [0, 1, 2]
    with pytest.raises(RuntimeError, match="a Tensor with 2 elements cannot be converted"):
        torch.ones(2, device="neuron").item()


def test_printing_matches_cpu_plus_device():
    cases = [torch.randn(3, 3), torch.arange(2000.0), torch.ones(2, dtype=torch.bfloat16),
             torch.tensor(3), torch.ones(2, 2, dtype=torch.float64) * 2, torch.empty(0)]
    for i, cpu in enumerate(cases):
        dev = f"neuron:{i % 4}"
        text = repr(cpu.to(dev))
        assert f"device='{dev}'" in text
        assert text.replace(f", device='{dev}'", "") == repr(cpu)
    g = torch.ones(2, device="neuron", requires_grad=True)
    assert repr(g) == "tensor([1., 1.], device='neuron:0', requires_grad=True)"
    torch_neuronx.clear_op_tracking()
    str(torch.randn(3, 3, device="neuron"))
    # formatting runs on a host copy: on the device only randn (allocation and fill) and the
    # one copy to the host ran
    assert set(torch_neuronx.get_executed_ops()) == {
        "aten::empty.memory_format", "aten::normal_", "aten::_to_copy", "aten::copy_"}


# ---- serialization and storages ----------------------------------------------------------------


def test_deepcopy():
    x = torch.randn(4, device="neuron:1", requires_grad=True)
    (x * 3).sum().backward()
    y = copy.deepcopy(x)
    assert y.device == x.device and y.requires_grad and y.data_ptr() != x.data_ptr()
    assert torch.equal(y.detach().cpu(), x.detach().cpu())
    assert y.grad.device == x.device and torch.equal(y.grad.cpu(), torch.full((4,), 3.0))
    base = torch.arange(4.0, device="neuron:2")
    d = copy.deepcopy({"base": base, "view": base[1:]})
    d["base"][1] = 100.0  # the copy keeps the view relation, on its own storage
    assert d["view"][0].item() == 100.0 and base[1].item() == 1.0
    m = torch.nn.Linear(3, 3).to("neuron:3")
    m2 = copy.deepcopy(m)
    assert m2.weight.device == torch.device("neuron:3")
    assert torch.equal(m2.weight.detach().cpu(), m.weight.detach().cpu())


def test_pickle():
    x = torch.randn(3, 4, device="neuron:1")
    y = pickle.loads(pickle.dumps(x))
    assert y.device == torch.device("neuron:1") and torch.equal(y.cpu(), x.cpu())
    p = torch.nn.Parameter(torch.ones(2, device="neuron:2"))
    q = pickle.loads(pickle.dumps(p))
    assert isinstance(q, torch.nn.Parameter) and q.device == p.device and q.requires_grad


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_torch_save_and_load_with_map_location():
    a = torch.randn(3, device="neuron:1")
    base = torch.arange(6, device="neuron")
    obj = {"a": a, "base": base, "view": base[2:]}
    loaded = torch.load(_saved(obj))
    assert loaded["a"].device == torch.device("neuron:1")
    assert loaded["base"].device == torch.device("neuron:0")
    assert torch.equal(loaded["a"].cpu(), a.cpu())
    loaded["base"][2] = 42  # views saved together still share storage after loading
    assert loaded["view"][0].item() == 42
    cpu = torch.load(_saved(obj), map_location="cpu")
    assert cpu["a"].device.type == "cpu" and torch.equal(cpu["a"], a.cpu())
    moved = torch.load(_saved(obj), map_location="neuron:2")
    assert {t.device for t in moved.values()} == {torch.device("neuron:2")}
    mapped = torch.load(_saved(a), map_location={"neuron:1": "neuron:3"})
    assert mapped.device == torch.device("neuron:3") and torch.equal(mapped.cpu(), a.cpu())
    sd = torch.nn.Linear(3, 2).state_dict()
    on_neuron = torch.load(_saved(sd), map_location=torch.device("neuron", 1), weights_only=True)
    assert all(t.device == torch.device("neuron:1") for t in on_neuron.values())
    assert all(torch.equal(on_neuron[k].cpu(), sd[k]) for k in sd)


def test_safetensors_roundtrip(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(4, 3, device="neuron:1"), "i": torch.arange(5, device="neuron")}
    path = str(tmp_path / "m.safetensors")
    st.save_file(tensors, path)  # saving from neuron works: safetensors copies to the host
    # safetensors' Rust loader only knows the devices it was built for (cpu, cuda, mps, ...)
    # and rejects "neuron" itself, before PyTorch sees it. So load on CPU, then move.
    with pytest.raises(Exception, match="neuron"):
        st.load_file(path, device="neuron")
    loaded = {k: v.to("neuron") for k, v in st.load_file(path, device="cpu").items()}
    for k, v in tensors.items():
        assert loaded[k].device == torch.device("neuron:0") and loaded[k].dtype == v.dtype
        assert torch.equal(loaded[k].cpu(), v.cpu())
    assert torch.equal(st.load(st.save(tensors))["w"], tensors["w"].cpu())


def test_untyped_storage():
    s = torch.UntypedStorage(16, device="neuron")
    assert s.device == torch.device("neuron:0") and s.nbytes() == 16 and len(s) == 16
    s.fill_(7)
    c = s.clone()
    assert c.device == s.device and c.data_ptr() != s.data_ptr()
    assert c.tolist() == [7] * 16
    s.fill_(1)  # the clone is independent
    assert c.tolist() == [7] * 16 and s.tolist() == [1] * 16
    s1 = torch.UntypedStorage(8, device="neuron:1")
    s1.copy_(torch.UntypedStorage(8).fill_(3))
    assert s1.device == torch.device("neuron:1") and s1.clone().device == s1.device
    assert s1.cpu().tolist() == [3] * 8 and s1.cpu().device.type == "cpu"
    t = torch.tensor([], dtype=torch.uint8, device="neuron:1").set_(s1)
    assert t.tolist() == [3] * 8
    assert torch.ones(2).untyped_storage().neuron().device.type == "neuron"


# ---- devices -----------------------------------------------------------------------------------


def test_mixed_devices_raise_cuda_error():
    a, b = torch.ones(2, 2, device="neuron:0"), torch.ones(2, 2, device="neuron:1")
    cases = {
        "add": lambda: a + b, "add_": lambda: a.add_(b), "mm": lambda: a @ b,
        "cat": lambda: torch.cat([a, b]), "index": lambda: a[torch.tensor([0], device="neuron:1")],
        "where": lambda: torch.where(a > 0, b, 0.0),
        "linear": lambda: torch.nn.functional.linear(a, b),
    }
    for name, f in cases.items():
        with pytest.raises(RuntimeError, match=SAME_DEVICE + ", neuron:0 and neuron:1") as info:
            f()
        assert "tensor.to('neuron:0')" in str(info.value), name
    with pytest.raises(RuntimeError, match=SAME_DEVICE + ", neuron:0 and cpu"):
        a + torch.ones(2, 2)
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.nn.Linear(2, 2)(a)  # CPU weights, neuron input
    # what CUDA also allows: CPU 0-dim scalars, CPU index tensors
    assert torch.equal((b + torch.tensor(2.0)).cpu(), torch.full((2, 2), 3.0))
    assert b[torch.tensor([1])].device == torch.device("neuron:1")


def test_unknown_device_index():
    """Using a device that does not exist is TorchNeuron's RuntimeError (with the fix);
    selecting one is its ValueError."""
    fix = "this emulated instance has 4 logical NeuronCore(s)"
    for i, make in ((4, lambda: torch.empty(1, device="neuron:4")),
                    (7, lambda: torch.ones(2).to("neuron:7")),
                    (4, lambda: torch.randn(2, device="neuron:4"))):
        with pytest.raises(RuntimeError, match=f"Device index {i} is out of range. Valid range "
                                               "is 0 to 3 for this process") as info:
            make()
        assert not isinstance(info.value, ValueError)
        assert fix in str(info.value) and "NEURON_RT_VISIBLE_CORES" in str(info.value)
    for i, make in ((5, lambda: torch.neuron.set_device(5)),
                    (9, lambda: torch.neuron.device(9).__enter__())):
        with pytest.raises(ValueError, match=f"Invalid device id: {i}. Valid range is 0 to 3"):
            make()
    assert torch.neuron.current_device() == 0


def test_cpu_tensors_rejected_as_torchneuron_rejects_them():
    """A non-scalar CPU tensor given to a neuron op gets TorchNeuron's message; an index
    tensor left on CPU is accepted only where TorchNeuron's kernel takes one (indexing with
    `x[idx]`), not by index_select / index_add / index_put_, whose device kernels reject it."""
    x = torch.arange(12.0, device="neuron").view(3, 4)
    idx = torch.tensor([0, 2])
    cases = {
        "mm": lambda: x @ torch.ones(4, 2),
        "index_select": lambda: torch.index_select(x, 0, idx),
        "index_add": lambda: x.index_add(0, idx, torch.ones(2, 4, device="neuron")),
        "index_put_": lambda: x.index_put_((idx,), torch.tensor(1.0, device="neuron")),
        "embedding": lambda: torch.nn.functional.embedding(idx, x),
    }
    for name, f in cases.items():
        with pytest.raises(RuntimeError, match=r"Non-scalar tensor arg\d is on cpu device, "
                                               "expected neuron") as info:
            f()
        assert SAME_DEVICE in str(info.value), name
    torch.testing.assert_close(x[idx].cpu(), torch.arange(12.0).view(3, 4)[idx])
    assert "aten::index" in ops.op_classes()[2]
    assert "aten::index_select" not in ops.op_classes()[2]
    assert "aten::index_reduce" in ops.op_classes()[2]  # a host op: CPU indices accepted


def test_errors_users_see_match_torchneuron():
    a, b = torch.ones(2, 3, device="neuron"), torch.ones(4, 5, device="neuron")
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied "
                                           r"\(2x3 and 4x5\)"):
        a @ b
    dst = torch.empty(0, device="neuron")
    assert torch._copy_from_and_resize(torch.ones(2, 3), dst) is dst and dst.shape == (2, 3)
    with pytest.raises(RuntimeError, match="only support copy with same size"):
        torch._copy_from_and_resize(torch.ones(10, 20), torch.empty(5, 5, device="neuron"))
    with pytest.raises(RuntimeError, match="only support copy from cpu tensor to neuron"):
        torch._copy_from_and_resize(torch.ones(2, device="neuron"),
                                    torch.empty(0, device="neuron"))


@pytest.mark.parametrize("dev", ["cpu", "neuron"])
def test_flash_attention_refused_as_torchneuron_refuses_it(dev):
    """PyTorch has `_flash_attention_forward`/`_backward` (varlen attention, torchtitan's
    `gpt_oss_debugmodel` default) on CUDA only. TorchNeuron registers no kernel for them:
    its CPU fallback runs them on the host, where torch has none, so they raise torch's
    NotImplementedError naming the op and the CPU backend; neuron gives the same one."""
    from torch.nn.attention.varlen import varlen_attn

    q = torch.randn(8, 2, 4).to(dev).requires_grad_()
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=dev)
    with warnings.catch_warnings(), pytest.raises(
            NotImplementedError, match=r"Could not run 'aten::_flash_attention_forward' with "
                                       r"arguments from the 'CPU' backend"):
        warnings.simplefilter("ignore")  # neuron's fallback warning, TorchNeuron's too
        varlen_attn(q, q, q, cu, cu, 5, 5, window_size=(-1, 0))  # causal
    t, lse = q.detach(), torch.zeros(2, 8, device=dev)
    rng = torch.zeros(2, dtype=torch.uint64, device=dev)
    with warnings.catch_warnings(), pytest.raises(
            NotImplementedError, match=r"Could not run 'aten::_flash_attention_backward' with "
                                       r"arguments from the 'CPU' backend"):
        warnings.simplefilter("ignore")
        torch.ops.aten._flash_attention_backward(t, t, t, t, t, lse, cu, cu, 5, 5, 0.0, True,
                                                 rng, torch.empty(0, device=dev))


def test_contiguous_memory_formats_as_torchneuron(monkeypatch):
    """preserve_format means contiguous; channels_last runs as on CPU with TorchNeuron's
    release build value, and is its error with
    TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS=1."""
    x = torch.randn(3, 4, device="neuron").t()
    y = x.contiguous(memory_format=torch.preserve_format)
    assert y.is_contiguous() and torch.equal(y.cpu(), x.cpu().contiguous())
    x.requires_grad_()
    x.contiguous(memory_format=torch.preserve_format).sum().backward()
    assert torch.equal(x.grad.cpu(), torch.ones(4, 3))
    z = torch.randn(2, 3, 4, 5, device="neuron")
    monkeypatch.setenv("TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS", "0")
    assert z.contiguous(memory_format=torch.channels_last).is_contiguous(
        memory_format=torch.channels_last)
    monkeypatch.setenv("TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS", "1")
    with pytest.raises(RuntimeError, match="Neuron tensors only support contiguous or preserve "
                                           "memory format"):
        z.contiguous(memory_format=torch.channels_last)


# ---- autograd ----------------------------------------------------------------------------------


def _mlp_grads(dev: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model.to(dev)
    x = torch.randn(5, 6).to(dev).requires_grad_()
    target = torch.tensor([0, 2, 1, 1, 0]).to(dev)
    loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    (gx,) = torch.autograd.grad((x.pow(3) * 2).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), x)  # double backward
    grads = [p.grad for p in model.parameters()] + [x.grad, gx, ggx]
    return loss, grads


def test_autograd_on_neuron_1_matches_cpu():
    loss, grads = _mlp_grads("neuron:1")
    cpu_loss, cpu_grads = _mlp_grads("cpu")
    assert loss.device == torch.device("neuron:1")
    torch.testing.assert_close(loss.cpu(), cpu_loss)
    for g, c in zip(grads, cpu_grads, strict=True):
        assert g.device == torch.device("neuron:1")
        torch.testing.assert_close(g.detach().cpu(), c.detach())
    assert torch.neuron.current_device() == 0
    a = torch.randn(3, device="neuron:0", requires_grad=True)
    (a.to("neuron:2") * torch.arange(3.0, device="neuron:2")).sum().backward()
    assert a.grad.device == torch.device("neuron:0")
    assert torch.equal(a.grad.cpu(), torch.arange(3.0))


# ---- autocast ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast(dtype):
    # CUDA's casting policy, as TorchNeuron documents, which differs from CPU autocast's
    # (there softmax stays in the low dtype), so the reference is computed by hand with the
    # casts CUDA would make.
    torch.manual_seed(0)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    lin = torch.nn.Linear(8, 4)
    conv_x, conv_w = torch.randn(1, 2, 6), torch.randn(3, 2, 2)
    m = copy.deepcopy(lin).to("neuron")
    with torch.autocast(device_type="neuron", dtype=dtype):
        assert torch.is_autocast_enabled("neuron") and torch.get_autocast_dtype("neuron") == dtype
        mm = a.to("neuron") @ b.to("neuron")  # lower-precision list
        out = m(a.to("neuron"))
        conv = torch.nn.functional.conv1d(conv_x.to("neuron"), conv_w.to("neuron"))
        soft = torch.softmax(mm, -1)  # fp32 list: computed in float32 from the low dtype
        logsm = torch.log_softmax(a.to("neuron"), -1)
        cat = torch.cat([mm, a.to("neuron")])  # promote list: the widest input type
        loss = torch.nn.functional.mse_loss(out, torch.zeros(8, 4, device="neuron"))
    assert not torch.is_autocast_enabled("neuron")
    loss.backward()
    got = [mm, out, conv, soft, logsm, cat, loss, m.weight.grad]
    assert [t.dtype for t in got] == [dtype] * 3 + [torch.float32] * 5

    w = lin.weight.detach().to(dtype).requires_grad_()
    mm_ref = a.to(dtype) @ b.to(dtype)
    out_ref = torch.nn.functional.linear(a.to(dtype), w, lin.bias.detach().to(dtype))
    loss_ref = torch.nn.functional.mse_loss(out_ref.float(), torch.zeros(8, 4))
    loss_ref.backward()
    want = [mm_ref, out_ref, torch.nn.functional.conv1d(conv_x.to(dtype), conv_w.to(dtype)),
            torch.softmax(mm_ref.float(), -1), torch.log_softmax(a, -1),
            torch.cat([mm_ref.float(), a]), loss_ref, w.grad.float()]
    for name, g, r in zip(["mm", "linear", "conv", "softmax", "log_softmax", "cat", "loss",
                           "grad"], got, want, strict=True):
        torch.testing.assert_close(g.detach().cpu(), r.detach().to(g.dtype), msg=name)


def test_autocast_bans_binary_cross_entropy():
    p = torch.rand(4, device="neuron")
    t = torch.rand(4, device="neuron")
    with torch.autocast(device_type="neuron", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="unsafe to autocast.*binary_cross_entropy_with_"):
            torch.nn.functional.binary_cross_entropy(p, t)
        ok = torch.nn.functional.binary_cross_entropy_with_logits(p, t)
    assert ok.dtype == torch.float32
    torch.testing.assert_close(torch.nn.functional.binary_cross_entropy(p, t).cpu(),
                               torch.nn.functional.binary_cross_entropy(p.cpu(), t.cpu()))


# ---- random numbers ----------------------------------------------------------------------------


def _draws(dev: str):
    return [
        torch.randn(16, device=dev), torch.rand(16, device=dev),
        torch.randint(0, 100, (16,), device=dev), torch.randperm(12, device=dev),
        torch.normal(torch.zeros(8, device=dev), 2.0),
        torch.bernoulli(torch.full((32,), 0.3, device=dev)),
        torch.empty(8, device=dev).uniform_(-2, 2),
        torch.multinomial(torch.ones(10, device=dev), 4),
        torch.nn.functional.dropout(torch.ones(64, device=dev), 0.4),
    ]


@pytest.mark.parametrize("dev", ["neuron:0", "neuron:2"])
def test_same_seed_same_numbers_as_cpu(dev):
    torch.manual_seed(1234)
    want = _draws("cpu")
    torch.manual_seed(1234)
    got = _draws(dev)
    for g, w in zip(got, want, strict=True):
        assert g.device == torch.device(dev) and g.dtype == w.dtype
        assert torch.equal(g.cpu(), w)
    mask = got[-1] != 0  # dropout mask and scaling are CPU's
    assert 0 < mask.sum().item() < 64
    torch.testing.assert_close(got[-1][mask].cpu(), torch.full((int(mask.sum()),), 1 / 0.6))


def test_rng_stream_is_cpus_across_cores():
    """Every core draws from CPU's global generator, as TorchNeuron's CPU fallback does: draws
    on neuron:0, neuron:1 and CPU continue one stream, and seeding a core's generator changes
    its state, not the draws. A neuron generator passed in draws CPU's stream for its seed."""
    torch.manual_seed(0)
    want = torch.randn(15)
    torch.manual_seed(0)
    with torch.neuron.device(1):
        torch.neuron.manual_seed(7)
    got = torch.cat([torch.randn(5, device="neuron:0").cpu(),
                     torch.randn(5, device="neuron:1").cpu(), torch.randn(5)])
    assert torch.equal(got, want)
    g = torch.Generator(device="neuron").manual_seed(3)
    assert torch.equal(torch.randn(4, device="neuron", generator=g).cpu(),
                       torch.randn(4, generator=torch.Generator().manual_seed(3)))


def test_native_dropout_as_torchneuron():
    """TorchNeuron's native_dropout draws its keep mask from CPU's global generator (CPU's
    mask after the same seed), draws nothing for p of 0 or 1 or in eval mode, and refuses a
    p outside [0, 1] in training."""
    x = torch.randn(6, 40)
    torch.manual_seed(3)
    want, want_mask = torch.native_dropout(x, 0.3, True)
    after = torch.rand(3)
    torch.manual_seed(3)
    got, mask = torch.native_dropout(x.to("neuron"), 0.3, True)
    assert torch.equal(got.cpu(), want) and torch.equal(mask.cpu(), want_mask)
    assert mask.dtype == torch.bool and mask.device.type == "neuron"
    assert torch.equal(torch.rand(3, device="neuron").cpu(), after)
    torch.manual_seed(4)
    want = torch.rand(3)
    torch.manual_seed(4)
    for p, train in ((0.0, True), (1.0, True), (0.5, False), (1.5, False)):
        out, mask = torch.native_dropout(x.to("neuron"), p, train)
        assert bool(mask.all()) == (p != 1.0 or not train)
        assert torch.equal(out.cpu(), x * 0 if p == 1.0 and train else x)
    assert torch.equal(torch.rand(3, device="neuron").cpu(), want)
    for p in (-0.5, 1.1):
        with pytest.raises(RuntimeError, match="dropout probability has to be between 0 and 1"):
            torch.native_dropout(x.to("neuron"), p, True)


# ---- Trainium numerics: 64-bit computed as 32-bit ----------------------------------------------


def test_float64_is_computed_as_float32():
    x = torch.tensor(1.0, dtype=torch.float64)
    tiny = torch.tensor(1e-10, dtype=torch.float64)
    torch_neuronx.clear_op_tracking()
    r = x.to("neuron") + tiny.to("neuron")
    assert r.dtype == torch.float64 and r.device.type == "neuron"
    assert r.item() == 1.0 and (x + tiny).item() == 1.0000000001
    assert torch_neuronx.get_downcast_ops() == {"aten::add.Tensor": 1}
    cancel = torch.tensor([1e8, 1.0, -1e8], dtype=torch.float64)
    assert cancel.sum().item() == 1.0 and cancel.to("neuron").sum().item() == 0.0
    assert neuronlocal.get_downcast_ops() == torch_neuronx.get_downcast_ops()
    # ordinary values agree with CPU float64 to float32 precision
    torch.manual_seed(0)
    a = torch.randn(16, 16, dtype=torch.float64)
    got = (a.to("neuron") @ a.to("neuron")).exp().sum(0)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), (a @ a).exp().sum(0), rtol=1e-5, atol=1e-5)
    assert not torch.equal(got.cpu(), (a @ a).exp().sum(0))
    # data movement is exact: no downcast for copies, indexing, concatenation
    torch_neuronx.clear_op_tracking()
    big = torch.tensor([2**40 + 1, 3], device="neuron")
    moved = torch.cat([big, big[:1]]).to("neuron:1")
    assert moved.tolist() == [2**40 + 1, 3, 2**40 + 1]
    assert torch_neuronx.get_downcast_ops() == {}


def test_int64_keeps_dtype_and_small_values_exact():
    torch_neuronx.clear_op_tracking()
    x = torch.arange(10)
    got = (x.to("neuron") * 3 + 1).sum()
    assert got.dtype == torch.int64 and got.item() == (x * 3 + 1).sum().item()
    assert torch_neuronx.get_downcast_ops() == {
        "aten::mul.Tensor": 1, "aten::add.Tensor": 1, "aten::sum.dim_IntList": 1}


def test_64bit_rule_keeps_a_result_dtype_the_call_names():
    """An int64 input computed as int32 gives int64 back, but a result dtype the call asks
    for is CPU's: torchtitan's MoE offsets, cumsum(..., dtype=torch.int32), stay int32 (its
    grouped GEMM takes int32 offsets only), and a float64 sum asked in float32 stays float32."""
    counts = torch.tensor([3, 1, 4])
    for dtype in (torch.int32, torch.int64):
        got = torch.cumsum(counts.to("neuron"), dim=0, dtype=dtype)
        want = torch.cumsum(counts, dim=0, dtype=dtype)
        assert got.dtype == want.dtype == dtype and torch.equal(got.cpu(), want)
    assert torch.cumsum(counts.to("neuron"), dim=0).dtype == torch.int64
    x = torch.tensor([1.5, 2.25], dtype=torch.float64)
    assert x.to("neuron").sum(dtype=torch.float32).dtype == torch.float32
    assert x.to("neuron").sum().dtype == torch.float64


def test_downcast_switch_at_run_time(policy):
    policy(downcast_64bit=False)
    torch_neuronx.clear_op_tracking()
    one = torch.ones((), dtype=torch.float64, device="neuron")
    assert (one + 1e-10).item() == 1.0000000001
    assert torch_neuronx.get_downcast_ops() == {}
    policy(downcast_64bit=True)
    assert (one + 1e-10).item() == 1.0


DOWNCAST_SCRIPT = """
import json, torch, torch_neuronx
r = torch.ones((), dtype=torch.float64, device="neuron") + 1e-10
s = torch.tensor([1e8, 1.0, -1e8], dtype=torch.float64, device="neuron").sum()
print(json.dumps([r.item(), s.item(), str(r.dtype), torch_neuronx.get_downcast_ops()]))
"""


def test_downcast_env_off_in_subprocess(fresh_python):
    r = fresh_python(DOWNCAST_SCRIPT, env={"NEURONLOCAL_DOWNCAST_64BIT": "0"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == [1.0000000001, 1.0, "torch.float64", {}]


# ---- op tracking, CPU fallback and strict mode ---------------------------------------------------


def test_executed_ops_tracking():
    torch_neuronx.clear_op_tracking()
    assert torch_neuronx.get_executed_ops() == {}
    a = torch.ones(2, 2).to("neuron")  # a copy only
    a @ a
    a @ a
    a + a
    ops = torch_neuronx.get_executed_ops()
    assert ops["aten::mm"] == 2 and ops["aten::add.Tensor"] == 1
    assert torch_neuronx.get_fallback_ops() == {}
    torch_neuronx.clear_op_tracking()
    assert torch_neuronx.get_executed_ops() == {} == torch_neuronx.get_fallback_ops()


def test_tracking_records_the_op_the_user_called():
    """TorchNeuron records the op it registers, before any decomposition: embedding (not only
    index_select), stack (not only cat), ones/ones_like (not only fill_), and the kernels
    neuron registers itself (empty, resize_, native_dropout, convolution, ...)."""
    w = torch.randn(10, 4, device="neuron")
    a = torch.ones(2, 3, device="neuron")
    conv = torch.nn.Conv2d(2, 3, 3).to("neuron")
    torch_neuronx.clear_op_tracking()
    torch.nn.functional.embedding(torch.tensor([1, 3], device="neuron"), w)
    torch.stack([a, a])
    torch.ones(2, device="neuron")
    torch.ones_like(a)
    a.new_empty(4)
    a.clone()
    torch.empty(3, device="neuron").resize_(5)
    torch.nn.functional.dropout(a, 0.5, training=True)
    conv(torch.randn(1, 2, 5, 5, device="neuron", requires_grad=True)).sum().backward()
    p = torch.nn.Parameter(torch.ones(2))
    p.data = torch.zeros(2, device="neuron")
    ran = torch_neuronx.get_executed_ops()
    for op in ("aten::embedding", "aten::index_select", "aten::stack", "aten::ones",
               "aten::ones_like", "aten::new_empty", "aten::clone", "aten::empty.memory_format",
               "aten::resize_", "aten::native_dropout", "aten::convolution",
               "aten::convolution_backward", "aten::_has_compatible_shallow_copy_type"):
        assert ran.get(op, 0) >= 1, (op, sorted(ran))
    assert set(torch_neuronx.get_fallback_ops()) == {"aten::normal_"}  # randn: a host op
    # the mechanism covers every device op torch implements as an explicit composite
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert {"embedding", "stack", "ones_like", "convolution"} <= set(ops.tracked_composites())
    assert all(has(f"aten::{n}", "PrivateUse1") for n in ops.tracked_composites())


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("mask", [(True, False, True), (False, False, True), (True, True, False),
                                  (False, True, False)])
def test_convolution_backward_returns_none_for_what_the_mask_leaves_out(dims, mask):
    """A gradient `output_mask` leaves out is None, as TorchNeuron's kernel gives it (CPU's
    kernel returns the weight's in its 2-D working layout when the bias's is asked for);
    the others match CPU's."""
    g = torch.Generator().manual_seed(0)
    size = (10,) * dims
    x = torch.randn(2, 3, *size, generator=g, requires_grad=True)
    w, go = torch.randn(2, 3, *(3,) * dims, generator=g), torch.randn(2, 2, *size, generator=g)

    def grads(dev: str) -> tuple:
        return torch.ops.aten.convolution_backward(
            go.to(dev), x.to(dev), w.to(dev), bias_sizes=[2], stride=(1,) * dims,
            padding=(1,) * dims, dilation=(1,) * dims, transposed=False,
            output_padding=(0,) * dims, groups=1, output_mask=list(mask))

    for wanted, got, ref in zip(mask, grads("neuron"), grads("cpu"), strict=True):
        if wanted:
            torch.testing.assert_close(got.cpu(), ref)
        else:
            assert got is None


def test_sync_batch_norm_helper_ops_match_batch_norm():
    """The ops nn.SyncBatchNorm calls (ATen has CUDA kernels only) run on neuron and give,
    for one rank, what batch_norm gives: forward, running statistics and gradients."""
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(6, 3, 4, 4, generator=g), torch.randn(6, 3, 4, 4, generator=g)
    weight, bias = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g)
    eps, momentum = 1e-5, 0.1
    xr = x.clone().requires_grad_()
    wr = weight.clone().requires_grad_()
    rm, rv = torch.zeros(3), torch.ones(3)
    want = torch.nn.functional.batch_norm(xr, rm, rv, wr, bias, True, momentum, eps)
    want.backward(dy)
    n = lambda t: t.to("neuron")  # noqa: E731
    xn, rmn, rvn = n(x), n(torch.zeros(3)), n(torch.ones(3))
    mean, invstd = torch.batch_norm_stats(xn, eps)
    count = torch.full((1,), float(x.numel() // 3), device="neuron")
    gmean, ginvstd = torch.batch_norm_gather_stats_with_counts(
        xn, mean[None], invstd[None], rmn, rvn, momentum, eps, count)
    y = torch.batch_norm_elemt(xn, n(weight), n(bias), gmean, ginvstd, eps)
    torch.testing.assert_close(y.cpu(), want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rmn.cpu(), rm)
    torch.testing.assert_close(rvn.cpu(), rv)
    sum_dy, sum_dy_xmu, gw, gb = torch.batch_norm_backward_reduce(
        n(dy), xn, gmean, ginvstd, n(weight), True, True, True)
    torch.testing.assert_close(gw.cpu(), wr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gb.cpu(), dy.sum((0, 2, 3)), atol=1e-4, rtol=1e-4)
    gi = torch.batch_norm_backward_elemt(n(dy), xn, gmean, ginvstd, n(weight), sum_dy,
                                         sum_dy_xmu, count.int())
    assert gi.device.type == "neuron"
    torch.testing.assert_close(gi.cpu(), xr.grad, atol=1e-4, rtol=1e-4)


# TorchNeuron registers these linalg ops as explicit CPU fallbacks, so each falls back under
# its own name (not its .out piece); linalg_lu is not registered: its .out piece falls back.
LINALG = {
    "aten::linalg_qr": lambda a: torch.linalg.qr(a),
    "aten::linalg_inv_ex": lambda a: torch.linalg.inv(a),
    "aten::linalg_cholesky_ex": lambda a: torch.linalg.cholesky(a),
    "aten::_linalg_det": lambda a: torch.linalg.det(a),
    "aten::_linalg_slogdet": lambda a: torch.linalg.slogdet(a),
    "aten::_linalg_svd": lambda a: torch.linalg.svd(a),
    "aten::_linalg_eigh": lambda a: torch.linalg.eigh(a),
    "aten::triangular_solve": lambda a: torch.triangular_solve(a, a),
    "aten::linalg_lu.out": lambda a: torch.linalg.lu(a),
}


def _spd(dev: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    m = torch.randn(4, 4, generator=g)
    return (m @ m.T + 4 * torch.eye(4)).to(dev)


def test_linear_algebra_is_recorded_as_fallback():
    a, ref = _spd("neuron:1"), _spd("cpu")
    torch_neuronx.clear_op_tracking()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op, f in LINALG.items():
            got, want = f(a), f(ref)
            for g, w in zip(torch.utils._pytree.tree_leaves(got),
                            torch.utils._pytree.tree_leaves(want), strict=True):
                assert g.device == torch.device("neuron:1"), op
                torch.testing.assert_close(g.cpu(), w, msg=op)
        torch.linalg.inv(a)
    fallback = torch_neuronx.get_fallback_ops()
    assert fallback == {**dict.fromkeys(LINALG, 1), "aten::linalg_inv_ex": 2}
    ran = {ops.placement(op).host_op for op in torch_neuronx.get_executed_ops()}
    assert set(fallback) <= ran


FAILING_FORWARD_SCRIPT = """
import json, warnings, torch
class Failing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        torch.ops.aten.linalg_inv_ex.default(a)  # the op's first CPU fallback: it warns
        raise ValueError("forward failed")

    @staticmethod
    def backward(ctx, grad):
        return grad

a = (torch.eye(3) * 2).to("neuron").requires_grad_()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter(ACTION)
    try:
        Failing.apply(a)
        raised = None
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
print(json.dumps([raised, [str(w.message).split()[0] for w in caught]]))
"""


@pytest.mark.parametrize("action", ["ignore", "always", "error"])
def test_fallback_warning_in_a_failing_autograd_function(fresh_python, action):
    """torch.ops calls have no warning buffer of their own: a fallback's warning inside an
    autograd.Function's forward went to `apply`'s buffer, which `apply` issued while
    forward's error was set when forward raised (SystemError instead of the error). The
    fallback issues it through Python at once: forward's own error reaches the caller, and a
    filter that makes warnings errors raises the warning itself, where the op was called."""
    r = fresh_python(FAILING_FORWARD_SCRIPT.replace("ACTION", repr(action)))
    assert r.returncode == 0, r.stderr
    raised, warned = json.loads(r.stdout.splitlines()[-1])
    if action == "error":
        assert raised.startswith("UserWarning: aten::linalg_inv_ex executed via CPU fallback")
    else:
        assert raised == "ValueError: forward failed"
    assert warned == (["aten::linalg_inv_ex"] if action == "always" else [])


WARN_SCRIPT = """
import json, warnings, torch
warnings.simplefilter("always")
a = torch.eye(3, device="neuron") * 2
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
        torch.linalg.qr(a); torch.linalg.inv(a); torch.linalg.det(a)
print(json.dumps([str(w.message) for w in caught]))
"""


def test_one_fallback_warning_per_op(fresh_python):
    r = fresh_python(WARN_SCRIPT)
    assert r.returncode == 0, r.stderr
    messages = json.loads(r.stdout.splitlines()[-1])
    fallback = sorted(m.split()[0] for m in messages if "executed via CPU fallback" in m)
    assert fallback == ["aten::_linalg_det", "aten::linalg_inv_ex", "aten::linalg_qr"]


def test_strict_policy_at_run_time(policy):
    a = _spd("neuron")
    policy(strict=True)
    with pytest.raises(RuntimeError, match=r"aten::linalg_inv_ex has no Trainium kernel.*"
                                           "NEURONLOCAL_STRICT=1 makes CPU fallbacks errors"):
        torch.linalg.inv(a)
    with pytest.raises(RuntimeError, match=r"aten::atan2\.out \(reached from aten::atan2\) "
                                           "has no Trainium kernel"):
        torch.atan2(a, a)
    with pytest.raises(RuntimeError, match="aten::sum.* 64-bit floating point.*Cast to float32"):
        torch.ones(3, dtype=torch.float64, device="neuron").sum()
    assert (a @ a).sum().item() == pytest.approx((_spd("cpu") @ _spd("cpu")).sum().item())
    policy(strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(torch.linalg.inv(a).cpu(), torch.linalg.inv(_spd("cpu")))


STRICT_SCRIPT = """
import json, torch
out = {}
a = torch.eye(3, device="neuron") * 2
for name, f in {"inv": lambda: torch.linalg.inv(a),
                "f64": lambda: torch.ones(2, dtype=torch.float64, device="neuron") * 3,
                "randn": lambda: torch.randn(2, device="neuron")}.items():
    try:
        f()
        out[name] = "ok"
    except RuntimeError as e:
        out[name] = str(e)
out["f32"] = (a @ a).sum().item()
out["f64_copy"] = torch.ones(2, dtype=torch.float64).to("neuron").cpu().tolist()
out["dropout"] = torch.nn.functional.dropout(torch.ones(8, device="neuron"), 0.5).shape[0]
print(json.dumps(out))
"""


def test_strict_env_in_subprocess(fresh_python):
    r = fresh_python(STRICT_SCRIPT, env={"NEURONLOCAL_STRICT": "1"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["inv"].startswith("aten::linalg_inv_ex has no Trainium kernel: TorchNeuron runs "
                                 "it on CPU. "
                                 "NEURONLOCAL_STRICT=1 makes CPU fallbacks errors")
    assert out["f64"].startswith("aten::mul.Tensor got a 64-bit floating point tensor: Trainium "
                                 "computes float64 as float32. Cast to float32")
    assert out["randn"].startswith("aten::normal_ has no Trainium kernel")
    assert out["f32"] == 12.0 and out["f64_copy"] == [1.0, 1.0] and out["dropout"] == 8


# ---- Trainium rules: int64 range, sparse and quantized tensors -------------------------------


def test_int64_outside_int32_warns_once_per_op(policy):
    policy(downcast_64bit=True)
    small = torch.tensor([1, 2**31 - 1, -(2**31)], device="neuron")
    big = torch.tensor([2**40, 1], device="neuron")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # values that fit: no warning
        assert (small * 1).tolist() == [1, 2**31 - 1, -(2**31)]
    with pytest.warns(UserWarning, match=r"aten::sub.Tensor: the int64 value 1099511627776 does "
                                         r"not fit in int32.*NEURONLOCAL_DOWNCAST_64BIT=0"):
        wrapped = big - 1
    assert wrapped.tolist() != [2**40 - 1, 0]  # computed as int32, as on Trainium
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per op
        big - 1
    strided = torch.tensor([[1, -(2**35)], [3, 4]], device="neuron").t()  # not contiguous
    with pytest.warns(UserWarning, match=r"aten::add.Tensor: the int64 value -34359738368"):
        strided + 1
    with pytest.warns(UserWarning, match=r"aten::mul.Tensor: the int64 value 8589934592"):
        small * 2**33  # a Python int operand outside int32
    policy(downcast_64bit=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (big - 1).tolist() == [2**40 - 1, 0]


UNSUPPORTED = "not supported on neuron, as on Trainium"


@pytest.mark.parametrize("make", [
    lambda: torch.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], (2, 2), device="neuron"),
    lambda: torch.empty(2, 2, layout=torch.sparse_coo, device="neuron"),
    lambda: torch.zeros(2, 2, layout=torch.sparse_coo, device="neuron"),
    lambda: torch.sparse_csr_tensor([0, 1, 2], [0, 1], [1.0, 2.0], (2, 2), device="neuron"),
    lambda: torch.eye(2).to_sparse().to("neuron"),
    lambda: torch.eye(2).to_sparse_csr().to("neuron"),
    lambda: torch.eye(2, device="neuron").to_sparse(),
    lambda: torch.eye(2, device="neuron").to_sparse_csr(),
], ids=["coo_ctor", "empty", "zeros", "csr_ctor", "coo_to", "csr_to", "to_sparse", "to_csr"])
def test_sparse_is_not_supported_as_on_trainium(make):
    with pytest.raises(NotImplementedError, match=rf"sparse tensors are {UNSUPPORTED}.*"
                                                  r"to_dense\(\)"):
        make()


@pytest.mark.parametrize("make", [
    lambda: torch.quantize_per_tensor(torch.ones(2, device="neuron"), 0.1, 0, torch.qint8),
    lambda: torch._empty_affine_quantized([2], device="neuron", dtype=torch.qint8),
    lambda: torch.empty(2, dtype=torch.qint8, device="neuron"),
    lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8).to("neuron"),
], ids=["quantize", "empty_affine", "empty", "to"])
def test_quantized_is_not_supported_as_on_trainium(make):
    with pytest.raises(NotImplementedError, match=rf"quantized tensors are {UNSUPPORTED}.*"
                                                  r"dequantize\(\)"):
        make()


def test_histc_accepts_integers_like_device_kernels():
    """transformers' MoE routing calls histc on int32 ids on accelerators (not on CPU)."""
    ids = torch.tensor([0, 1, 1, 3, 3, 3], dtype=torch.int32)
    got = torch.histc(ids.to("neuron"), bins=4, min=0, max=3)
    assert got.dtype == torch.int32 and got.device.type == "neuron"
    assert got.cpu().tolist() == [1, 2, 0, 3]
    compiled = torch.compile(lambda e: torch.histc(e, bins=4, min=0, max=3), backend="neuron")
    assert compiled(ids.to("neuron")).cpu().tolist() == [1, 2, 0, 3]
    floats = torch.rand(50)
    torch.testing.assert_close(torch.histc(floats.to("neuron"), 5).cpu(), torch.histc(floats, 5))


def test_linear_backward_is_a_device_kernel():
    """TorchNeuron registers aten::linear_backward (ATen's CPU has no kernel for it): its
    gradients match autograd's on CPU, masked-off ones are None (as TorchNeuron's and
    MKLDNN's kernels return, so `.grad = ...` accepts them), and it is tracked as
    executed, not as a CPU fallback."""
    import torch_neuronx

    x = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    g = torch.randn(2, 3, 5)
    torch.nn.functional.linear(x, w, b).backward(g)
    torch_neuronx.clear_op_tracking()
    gi, gw, gb = torch.ops.aten.linear_backward(x.detach().to("neuron"), g.to("neuron"),
                                                w.detach().to("neuron"), [True, True, True])
    for got, want in ((gi, x.grad), (gw, w.grad), (gb, b.grad)):
        assert got.device.type == "neuron"
        torch.testing.assert_close(got.cpu(), want)
    assert torch_neuronx.get_executed_ops().get("aten::linear_backward") == 1
    assert not any("linear" in op for op in torch_neuronx.get_fallback_ops())
    only_input = torch.ops.aten.linear_backward(x.detach().to("neuron"), g.to("neuron"),
                                                w.detach().to("neuron"), [True, False, False])
    assert only_input[1] is None and only_input[2] is None
    torch.testing.assert_close(only_input[0].cpu(), x.grad)
    wn = w.detach().to("neuron")
    wn.grad = torch.ops.aten.linear_backward(x.detach().to("neuron"), g.to("neuron"), wn,
                                             [False, True, False])[0]
    assert wn.grad is None


def test_histc_out_dtype_mismatch_is_torchneuron_error(monkeypatch):
    """TorchNeuron's histc kernel names torch dtypes in its error (CPU's words without its
    MLIR ops); an `out` of the input's dtype gets the device result, integers included."""
    x = torch.rand(100, device="neuron")
    with pytest.raises(RuntimeError, match="same dtype, but got input torch.float32 and hist "
                                           "torch.int32"):
        torch.histc(x, bins=10, out=torch.zeros(10, device="neuron", dtype=torch.int32))
    monkeypatch.setenv("TORCH_NEURONX_MLIR_ATEN_OPS", "0")
    with pytest.raises(RuntimeError, match="same dtype, but got input float and hist int"):
        torch.histc(x, bins=10, out=torch.zeros(10, device="neuron", dtype=torch.int32))
    out = torch.empty(0, device="neuron")
    assert torch.histc(x, bins=10, out=out) is out
    torch.testing.assert_close(out.cpu(), torch.histc(x.cpu(), bins=10))
    ids = torch.tensor([0, 1, 1, 3], dtype=torch.int32, device="neuron")
    counts = torch.zeros(4, dtype=torch.int32, device="neuron")
    assert torch.histc(ids, bins=4, min=0, max=3, out=counts).cpu().tolist() == [1, 2, 0, 1]


# ---- TorchNeuron's op contract: copies, set_, softmax, attention -------------------------------


def test_set_takes_only_neuron_memory():
    t = torch.empty(0, device="neuron")
    for source, what in ((torch.randn(3), "source tensor"),
                         (torch.randn(3).untyped_storage(), "storage")):
        with pytest.raises(RuntimeError, match=f"set_: expected neuron {what}, but got {what} "
                                               "on device cpu"):
            t.set_(source)
    with pytest.raises(RuntimeError, match="expected neuron storage"):
        t.set_(torch.randn(3).untyped_storage(), 0, (3,))
    src = torch.arange(6.0, device="neuron")
    assert torch.equal(t.set_(src).cpu(), torch.arange(6.0)) and t.data_ptr() == src.data_ptr()
    u = torch.empty(0, device="neuron").set_(src.untyped_storage(), 2, (2, 2))
    assert u.cpu().tolist() == [[2.0, 3.0], [4.0, 5.0]]


def test_to_copy_is_one_device_op_for_every_cast():
    """`.to(dtype)` on neuron is TorchNeuron's `_to_copy` kernel, recorded as run on the device
    for 32-bit and 64-bit targets alike (its 64-bit bounce is internal to that kernel)."""
    x = torch.randn(8, 8, device="neuron")
    for dtype in (torch.float16, torch.float64, torch.int32):
        torch_neuronx.clear_op_tracking()
        y = x.to(dtype)
        assert torch_neuronx.get_executed_ops()["aten::_to_copy"] == 1, dtype
        assert torch_neuronx.get_fallback_ops() == {}
        assert torch_neuronx.get_downcast_ops() == {}
        assert y.dtype == dtype and y.device == x.device
        assert torch.equal(y.cpu(), x.cpu().to(dtype))


@pytest.mark.parametrize("op", [torch.ops.aten._softmax, torch.ops.aten._log_softmax])
def test_softmax_half_to_float_as_device_kernels(op):
    """CPU rejects `half_to_float`; TorchNeuron's (and CUDA's) kernels return float32 for a
    half input, and its backward gives the half input a half gradient."""
    x = torch.randn(3, 5, dtype=torch.float16)
    xn = x.to("neuron").requires_grad_()
    y = op.default(xn, 1, True)
    assert y.dtype == torch.float32 and y.device.type == "neuron"
    ref = x.float().requires_grad_()
    want = op.default(ref, 1, False)
    torch.testing.assert_close(y.cpu(), want.detach())
    g = torch.randn(3, 5)
    y.backward(g.to("neuron"))
    want.backward(g)
    assert xn.grad.dtype == torch.float16
    torch.testing.assert_close(xn.grad.cpu(), ref.grad.half(), atol=2e-3, rtol=2e-3)


def _qkv(*shape: int, grad: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(*shape).requires_grad_(grad) for _ in range(3)]


def _on_neuron(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to("neuron").requires_grad_(t.requires_grad) for t in ts]


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"mask": True}, {"scale": 0.3}])
def test_sdpa_overrideable_backend_runs_torchneuron_kernel(kwargs):
    """`sdpa_kernel([SDPBackend.OVERRIDEABLE])` runs TorchNeuron's fused kernel
    (`_scaled_dot_product_fused_attention_overrideable`, forward and backward) on 4D inputs;
    results and gradients match CPU's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv(2, 3, 5, 8, grad=True)
    extra = dict(kwargs)
    bias = None
    if extra.pop("mask", False):
        bias = torch.randn(2, 3, 5, 5, requires_grad=True)
        extra["attn_mask"] = bias
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **extra)
    want.sum().backward()
    qn, kn, vn = _on_neuron([q, k, v])
    if bias is not None:
        extra["attn_mask"] = bn = bias.detach().to("neuron").requires_grad_()
    torch_neuronx.clear_op_tracking()
    with sdpa_kernel([SDPBackend.OVERRIDEABLE]):
        got = torch.nn.functional.scaled_dot_product_attention(qn, kn, vn, **extra)
    got.sum().backward()
    ran = torch_neuronx.get_executed_ops()
    assert ran["aten::_scaled_dot_product_fused_attention_overrideable"] == 1
    assert ran["aten::_scaled_dot_product_fused_attention_overrideable_backward"] == 1
    torch.testing.assert_close(got.cpu(), want.detach())
    for a, b in zip((qn, kn, vn), (q, k, v), strict=True):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-4, rtol=1e-4)
    if bias is not None:
        torch.testing.assert_close(bn.grad.cpu(), bias.grad, atol=1e-4, rtol=1e-4)
    # by default neuron keeps CPU's choice of kernel (same numerics as CPU)
    torch_neuronx.clear_op_tracking()
    torch.nn.functional.scaled_dot_product_attention(qn, kn, vn)
    assert "aten::_scaled_dot_product_fused_attention_overrideable" not in (
        torch_neuronx.get_executed_ops())


def test_sdpa_overrideable_dropout_is_seeded_and_differentiable():
    """Dropout on the overrideable kernel draws from CPU's global generator (same seed, same
    result) and backward replays the same mask: the gradient matches a finite difference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _on_neuron(_qkv(1, 2, 6, 4))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run(qq: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(7)
        with sdpa_kernel([SDPBackend.OVERRIDEABLE]):
            return sdpa(qq, k, v, dropout_p=0.4)

    a, b = run(q), run(q)
    assert torch.equal(a.cpu(), b.cpu())
    with sdpa_kernel([SDPBackend.OVERRIDEABLE]):
        assert not torch.equal(a.cpu(), sdpa(q, k, v).cpu())
    qg = q.clone().requires_grad_()
    run(qg).sum().backward()
    direction = torch.randn(q.shape).to("neuron")
    h = 1e-2
    numeric = (run(q + h * direction).sum() - run(q - h * direction).sum()) / (2 * h)
    torch.testing.assert_close((qg.grad * direction).sum().cpu(), numeric.cpu(), atol=2e-2,
                               rtol=2e-2)


def test_native_multi_head_attention_as_torchneuron():
    """nn.MultiheadAttention's inference fast path calls `_native_multi_head_attention`:
    TorchNeuron's kernel returns CPU's output and an empty weights tensor, and rejects mask
    tensors and attention weights (need_weights=True) with its own errors."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    dev = copy.deepcopy(mha).to("neuron")
    xn = x.to("neuron")
    with torch.no_grad():
        want, _ = mha(x, x, x, need_weights=False)
        torch_neuronx.clear_op_tracking()
        got, weights = dev(xn, xn, xn, need_weights=False)
        assert torch_neuronx.get_executed_ops()["aten::_native_multi_head_attention"] == 1
        torch.testing.assert_close(got.cpu(), want)
        assert weights.device.type == "neuron" and weights.shape == (0,)
        with pytest.raises(NotImplementedError, match=r"need_weights=True\) is not yet supported"):
            dev(xn, xn, xn)
        with pytest.raises(NotImplementedError, match="Arbitrary mask tensors not yet supported"):
            dev(xn, xn, xn, need_weights=False,
                key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device="neuron"))
    args = (8, 2, *(p.detach() for p in (dev.in_proj_weight, dev.in_proj_bias,
                                         dev.out_proj.weight, dev.out_proj.bias)))
    causal, _ = torch._native_multi_head_attention(xn, xn, xn, *args, None, False, True, 1)
    mha.train()  # CPU's general path, with the causal mask spelled out
    with torch.no_grad():
        want_causal, _ = mha(x, x, x, attn_mask=torch.ones(5, 5, dtype=torch.bool).triu(1),
                             need_weights=False)
    torch.testing.assert_close(causal.cpu(), want_causal)
    assert not torch.allclose(causal.cpu(), want)
