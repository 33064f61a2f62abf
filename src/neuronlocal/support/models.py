"""Does a transformers model run on neuron? One model, every mode, compared with CPU.

`tiny.shrink(config)` derives a small config that keeps the architecture's layer kinds.
`check_model(...)` builds it, copies it to neuron, and runs each mode of the task on CPU
and on neuron: eager forward + backward and one AdamW step (two layers of each kind);
compiled forward (backend neuron) and then `shapes`, the same compiled model's forward +
backward at a new input size, where Dynamo recompiles with symbolic sizes as in a job whose
sequence length changes; static-cache `generate()`, whose decode graphs auto-compile on
neuron (compiled modes build one layer of each kind: compile time grows with depth, what is
tested does not). Outputs, losses, gradients, tokens and parameters are compared, and
compiled modes count their graphs. A mode that fails on CPU too is not held against neuron,
and a model that cannot be built is its own status: nothing ran, so nothing is blamed on
neuron.
"""

from __future__ import annotations

import copy
import re
import resource
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch

from neuronlocal import device as neuron
from neuronlocal.core import dynamo_metrics

MODES = ("eager", "compile", "shapes", "generate", "train")  # run in this order
TASK_MODES = {"causal-lm": MODES, "seq2seq": MODES,
              "masked-lm": ("eager", "compile", "shapes", "train"),
              "image-classification": ("eager", "compile", "shapes", "train")}
# Input sizes of the compiled model: the compile mode's (a static graph), then the shapes
# mode's, where Dynamo recompiles with symbolic sizes, which is where an architecture can
# fail; every further size would be one more compile of the same symbolic graph. Sequence
# lengths for text, batch sizes for images (a size of 1 would stay static).
SHAPE_LENGTHS = (12, 7)
SHAPE_BATCHES = (2, 3)
# Statuses: nothing ran on neuron for build-fail, skipped and cpu-fail.
STATUSES = ("pass", "neuron-fail", "cpu-fail", "build-fail", "skipped", "timeout", "crash")
# Families whose backward runs only in training mode (Reformer's reversible layers); their
# tiny configs turn dropout off, so training mode is as deterministic as eval.
TRAIN_MODE_BACKWARD = ("reformer",)
_MISSING_PACKAGE = re.compile(r"requires the (\S+) librar", re.IGNORECASE)


@dataclass
class ModeResult:
    cpu_ok: bool = False
    neuron_ok: bool = False
    max_diff: float | None = None
    error: str | None = None  # "ErrorClass: message" of the first failure
    seconds: float = 0.0  # wall time, CPU and neuron together
    cpu_seconds: float = 0.0  # processor time of this process and its compiler children
    graphs: int | None = None  # graphs compiled in this mode (compiled modes)


@dataclass
class ModelReport:
    model_type: str
    architecture: str
    status: str = "pending"  # one of STATUSES
    modes: dict[str, ModeResult] = field(default_factory=dict)
    seconds: float = 0.0
    compiles: int = 0
    peak_hbm: int = 0
    cores: int = 1
    params: int = 0
    layers: int | None = None
    fallback_ops: dict[str, int] = field(default_factory=dict)
    fallback_traffic: dict[str, dict[str, int]] = field(default_factory=dict)  # bytes, calls
    downcast_ops: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    notes: list[str] = field(default_factory=list)  # config repairs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    scale = max(b.abs().max().item(), 1.0)
    return (a - b).abs().max().item() / scale


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _cpu_time() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _run_mode(res: ModeResult, cpu_fn: Callable[[], list[Any]],
              neuron_fn: Callable[[], list[Any]], tol: float) -> None:
    start, cpu_start = time.perf_counter(), _cpu_time()
    try:
        _compare(res, cpu_fn, neuron_fn, tol)
    finally:
        res.seconds = time.perf_counter() - start
        res.cpu_seconds = _cpu_time() - cpu_start


def _compare(res: ModeResult, cpu_fn: Callable[[], list[Any]],
             neuron_fn: Callable[[], list[Any]], tol: float) -> None:
    try:
        ref = cpu_fn()
        res.cpu_ok = True
    except Exception as e:  # noqa: BLE001 - a CPU failure is a result, not a crash
        res.error = "cpu: " + _err(e)
        return
    try:
        got = neuron_fn()
    except Exception as e:  # noqa: BLE001
        res.error = _err(e)
        res.error += "\n" + "".join(traceback.format_exception(e)[-3:])[-800:]
        return
    if len(got) != len(ref):
        res.error = f"Mismatch: neuron returned {len(got)} tensors, CPU {len(ref)}"
        return
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if isinstance(r, torch.Tensor) and (not isinstance(g, torch.Tensor)
                                            or g.shape != r.shape):
            shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            res.error = (f"Mismatch: output {i} has shape {shape} on neuron, "
                         f"{tuple(r.shape)} on CPU")
            return
    diffs = [_close(g, r) if isinstance(r, torch.Tensor) and r.is_floating_point()
             else float(not torch.equal(g.cpu(), r.cpu())) for g, r in zip(got, ref, strict=True)]
    res.max_diff = max(diffs) if diffs else 0.0
    res.neuron_ok = res.max_diff <= tol
    if not res.neuron_ok:
        res.error = f"Mismatch: max relative difference {res.max_diff:.3g} > {tol:g}"


def build_tiny(config: Any, model_cls: Any, task: str, min_layers: int = 2
               ) -> tuple[Any, torch.nn.Module]:
    """The tiny config and a random model of `model_cls` on CPU, ready for `task`."""
    from neuronlocal.support import configs, tiny

    cfg = tiny.shrink(configs.config_for_class(config, model_cls), min_layers=min_layers)
    if task == "causal-lm" and hasattr(cfg, "is_decoder"):
        cfg.is_decoder = True  # encoder families as causal LMs (BertLMHeadModel and friends)
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    languages = getattr(cfg, "languages", None)
    if hasattr(model, "set_default_language") and languages:
        model.set_default_language(languages[0])  # X-MOD adapters need one picked
    return cfg, model


def _vocab(cfg: Any) -> int:
    return int(getattr(cfg, "vocab_size", None) or cfg.get_text_config().vocab_size)


def _forward_args(model: torch.nn.Module | None) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters) if model is not None else set()


def make_inputs(cfg: Any, task: str, size: int, gen: torch.Generator,
                model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Model inputs with labels: `size` is the sequence length (the batch size for images).

    Encoder-decoders get their decoder inputs from the model's own
    `prepare_decoder_input_ids_from_labels` where it has one, as transformers' seq2seq data
    collator does: FSMT does not derive them from the labels itself.
    """
    if task == "image-classification":
        vision = getattr(cfg, "vision_config", None) or cfg
        labels = torch.randint(0, max(int(getattr(cfg, "num_labels", 2)), 1), (size,),
                               generator=gen)
        if "pixel_values" not in _forward_args(model):  # ImageGPT: pixels as token ids
            ids = torch.randint(0, _vocab(cfg) - 1, (size, 16), generator=gen)
            return {"input_ids": ids, "labels": labels}
        channels = int(getattr(vision, "num_channels", 3) or 3)
        side = getattr(vision, "image_size", 32) or 32
        side = int(side[0] if isinstance(side, (list, tuple)) else side)
        if "spatial_shapes" in _forward_args(model):  # NaFlex: patches, not images
            patch = int(getattr(vision, "patch_size", 16))
            n = int(getattr(vision, "num_patches", 16))
            grid = int(n ** 0.5)
            return {"pixel_values": torch.randn(size, n, channels * patch * patch, generator=gen),
                    "pixel_attention_mask": torch.ones(size, n, dtype=torch.long),
                    "spatial_shapes": torch.tensor([[grid, n // grid]] * size),
                    "labels": labels}
        return {"pixel_values": torch.randn(size, channels, side, side, generator=gen),
                "labels": labels}
    books = int(getattr(cfg, "num_codebooks", 1) or 1)  # audio LMs: one row per codebook
    ids = torch.randint(3, _vocab(cfg) - 1, (2 * books, size), generator=gen)
    if task == "seq2seq" and getattr(cfg, "is_encoder_decoder", False):
        labels = torch.randint(3, _vocab(cfg) - 1, (2 * books, max(size // 2, 2)), generator=gen)
        batch = {"input_ids": ids, "labels": labels}
        prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
        if prepare is not None:
            batch["decoder_input_ids"] = prepare(labels=labels)
        return batch
    labels = ids if books == 1 else ids.view(2, books, size).transpose(1, 2)
    return {"input_ids": ids, "labels": labels}


def _to(inputs: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in inputs.items()}


def _fwd_bwd(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.train(getattr(model.config, "model_type", None) in TRAIN_MODE_BACKWARD)
    try:
        out = model(**inputs)
        _loss(out, inputs).backward()
    finally:
        model.eval()
    # A parameter the loss does not reach has no gradient in eager and a zero one where a
    # compiled graph returned the output it feeds (siglip2's unused pooling head): equal.
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad
             for p in params[:4] + params[-4:]]
    return [_logits(out), _loss(out, inputs), *grads]


def _loss(out: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's loss, or cross-entropy of its logits for heads that return none."""
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    logits = _logits(out)
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(),
                                             inputs["labels"].flatten())


def _graphs() -> int:
    """Graphs compiled so far; their Trainium estimates are not computed (nothing reads them)."""
    return dynamo_metrics.next_graph_id()


class _Compiled:
    """The model of the compile, shapes and generate modes, built once (one layer of each
    kind) and compiled once, as a job compiles its model: `compile` runs it at the first size
    under no_grad, `shapes` then runs forward + backward at the second size; `generate`
    decodes from the first size's prompt."""

    def __init__(self, config: Any, model_cls: Any, task: str) -> None:
        self.spec = (config, model_cls, task)
        self.cpu: torch.nn.Module | None = None
        self.ran = False

    def build(self) -> None:
        if self.cpu is not None:
            return
        config, model_cls, task = self.spec
        cfg, cpu = build_tiny(config, model_cls, task, min_layers=1)
        gen = torch.Generator().manual_seed(3)
        sizes = SHAPE_BATCHES if task == "image-classification" else SHAPE_LENGTHS
        self.batches = [make_inputs(cfg, task, n, gen, cpu) for n in sizes]
        self.dev = copy.deepcopy(cpu).to("neuron")
        self.cpu = cpu
        torch._dynamo.reset()  # a fresh frame: the first size compiles static, as in a new job
        self.compiled = cast(torch.nn.Module, torch.compile(self.dev, backend="neuron"))

    def forward(self) -> list[torch.Tensor]:
        """The compiled forward at the first size (no_grad), on neuron."""
        self.ran = True
        with torch.no_grad():
            return [_logits(self.compiled(**_to(self.batches[0], "neuron")))]


def _built(res: ModeResult, model: _Compiled) -> bool:
    try:
        model.build()
        return True
    except Exception as e:  # noqa: BLE001 - a model that cannot be built cannot be compared
        res.error = "cpu: build: " + _err(e)
        return False


def _compile(res: ModeResult, model: _Compiled) -> None:
    """Compiled forward at the first size vs CPU eager."""
    if not _built(res, model):
        return
    cpu, batch = model.cpu, model.batches[0]
    assert cpu is not None
    before = _graphs()
    try:
        with torch.no_grad():
            _run_mode(res, lambda: [_logits(cpu(**batch))], model.forward, 2e-3)
    finally:
        res.graphs = _graphs() - before


def _shapes(res: ModeResult, model: _Compiled) -> None:
    """Forward + backward of the compiled model at its second size vs CPU eager: the frame
    already ran at the first size, so Dynamo recompiles with symbolic sizes (automatic
    dynamic shapes, through neuron's fake tensors), which the backend specialises per
    concrete size, as TorchNeuron does."""
    if not _built(res, model):
        return
    cpu, batch = model.cpu, model.batches[1]
    assert cpu is not None
    first = not model.ran  # the compile mode did not run: the frame meets the first size here

    def on_neuron() -> list[torch.Tensor]:
        if first:
            model.forward()
        return _fwd_bwd(model.compiled, _to(batch, "neuron"))

    before = _graphs()
    try:
        _run_mode(res, lambda: _fwd_bwd(cpu, batch), on_neuron, 2e-3)
    finally:
        res.graphs = _graphs() - before


def _run_modes(rep: ModelReport, modes: tuple[str, ...], built: tuple[Any, Any, str],
               cpu_side: tuple[Any, dict[str, Any]], neuron_side: tuple[Any, dict[str, Any]],
               progress: Callable[[ModelReport], None] | None = None) -> None:
    """Each selected mode on CPU and neuron, into rep.modes, in MODES order (train last: it
    changes the weights); `progress(rep)` after each, so a row cut short keeps its modes."""
    cpu, inputs = cpu_side
    dev, inputs_n = neuron_side
    compiled = _Compiled(*built)
    runners: dict[str, Callable[[ModeResult], None]] = {
        "eager": lambda m: _run_mode(m, lambda: _fwd_bwd(cpu, inputs),
                                     lambda: _fwd_bwd(dev, inputs_n), 2e-3),
        "compile": lambda m: _compile(m, compiled),
        "shapes": lambda m: _shapes(m, compiled),
        "generate": lambda m: _generate(m, compiled),
        "train": lambda m: _run_mode(m, lambda: _train_step(cpu, inputs),
                                     lambda: _train_step(dev, inputs_n), 2e-3),
    }
    for mode in MODES:
        if mode in modes:
            rep.modes[mode] = m = ModeResult()
            runners[mode](m)
            if progress is not None:
                progress(rep)


def check_model(model_type: str, architecture: str, config: Any | None = None,
                modes: tuple[str, ...] = MODES, seq: int = 12, task: str = "causal-lm",
                model_cls: Any | None = None,
                progress: Callable[[ModelReport], None] | None = None) -> ModelReport:
    """Runs one architecture on CPU and neuron in every mode; see the module docstring.
    `progress(report)` is called after each mode (the matrix keeps what a slow row did)."""
    import transformers
    from transformers import CONFIG_MAPPING

    from neuronlocal.eager import tracking
    from neuronlocal.support.configs import build_config

    rep = ModelReport(model_type, architecture)
    start = time.perf_counter()
    try:
        model_cls = model_cls or getattr(transformers, architecture)
        if config is None:  # the model type's default config, repaired if it fails validation
            config, rep.notes = build_config(CONFIG_MAPPING[model_type], {})
        cfg, cpu = build_tiny(config, model_cls, task)
        dev = copy.deepcopy(cpu).to("neuron")
    except Exception as e:  # noqa: BLE001
        missing = _MISSING_PACKAGE.search(str(e))
        rep.status = "skipped" if missing else "build-fail"
        rep.error = (f"needs the optional package {missing.group(1)}, not installed: "
                     if missing else "build: ") + _err(e)
        rep.seconds = time.perf_counter() - start
        return rep
    rep.params = sum(p.numel() for p in cpu.parameters())
    rep.layers = next((getattr(cfg, k) for k in ("num_hidden_layers", "n_layer", "num_layers")
                       if isinstance(getattr(cfg, k, None), int)), None)
    gen = torch.Generator().manual_seed(1)
    inputs = make_inputs(cfg, task, seq if task != "image-classification" else 2, gen, cpu)
    inputs_n = _to(inputs, "neuron")
    dynamo_metrics.reset_dynamo_metrics()
    tracking.clear_op_tracking()
    neuron.reset_peak_memory_stats()
    # Random ops in compiled graphs draw from the eager generator (Inductor's parity switch),
    # so a model that draws in its forward (Reformer's LSH rotations) compares with CPU eager.
    with torch._inductor.config.patch(fallback_random=True):
        _run_modes(rep, modes, (config, model_cls, task), (cpu, inputs), (dev, inputs_n),
                   progress)
    rep.seconds = time.perf_counter() - start
    rep.compiles = _graphs()  # hits compile on Trainium too
    rep.peak_hbm = neuron.max_memory_allocated()
    rep.fallback_ops = tracking.get_fallback_ops()
    rep.fallback_traffic = tracking.get_fallback_traffic()
    rep.downcast_ops = tracking.get_downcast_ops()
    rep.status = classify(rep)
    return rep


def _generate(m: ModeResult, model: _Compiled) -> None:
    """Static-cache generate() of the compiled modes' model (one layer of each kind: the
    decode graphs compile on neuron) vs CPU, token for token."""
    def gen(module: Any, x: torch.Tensor) -> list[torch.Tensor]:
        # The batch has no padding: its mask is all ones, and the pad id is given, so
        # transformers has nothing to guess (and nothing to warn about).
        eos = getattr(module.generation_config, "eos_token_id", None)
        pad = module.generation_config.pad_token_id
        if pad is None:
            pad = (eos[0] if isinstance(eos, list) and eos else eos) if eos is not None else 0
        with torch.no_grad():
            return [module.generate(x, attention_mask=torch.ones_like(x), pad_token_id=pad,
                                    max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                    cache_implementation="static")]

    if not _built(m, model):
        return
    cpu, dev, ids = model.cpu, model.dev, model.batches[0]["input_ids"]
    if getattr(cpu, "_can_compile_fullgraph", True) is False:
        m.error = "unsupported: model does not support a static cache"
        return
    torch._dynamo.reset()  # a job of its own: no frame state from the compiled modes
    before = _graphs()
    _run_mode(m, lambda: gen(cpu, ids), lambda: gen(dev, ids.to("neuron")), 0.0)
    m.graphs = _graphs() - before


def _train_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    torch.manual_seed(2)  # same dropout masks: CPU and neuron draw from equal seeds
    model.train()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
        opt.step()
    finally:
        model.eval()
    params = list(model.parameters())
    return [p.detach() for p in params[:4] + params[-4:]]


def classify(rep: ModelReport) -> str:
    ran = [m for m in rep.modes.values() if m.cpu_ok]
    if not ran:
        rep.error = rep.error or next((m.error for m in rep.modes.values() if m.error), None)
        return "cpu-fail"
    if any(not m.neuron_ok for m in ran):
        bad = next(m for m in ran if not m.neuron_ok)
        rep.error = rep.error or bad.error
        return "neuron-fail"
    return "pass"
