"""Layers import downward: a module never imports a layer above its own.

LAYERS below is the one definition of the layer order; docs/architecture.md shows it and
this test checks that it shows the same order. Every import counts, including the ones
inside functions, since they run too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

# Lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("neuronlocal.core", "neuronlocal._C", "neuronlocal.patching")),
    ("eager", ("neuronlocal.eager",)),
    ("device", ("neuronlocal.memory", "neuronlocal.device", "neuronlocal.amp")),
    ("estimate", ("neuronlocal.estimate",)),
    ("backends", ("neuronlocal.compile", "neuronlocal.distributed", "neuronlocal.kernels")),
    ("integrations", ("neuronlocal.hf",)),
    ("tools", ("neuronlocal.support", "neuronlocal.report", "neuronlocal.serve")),
    ("entry", ("neuronlocal", "torch_neuronx")),
]


def layer_of(module: str) -> int:
    best, level = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    if level < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return level


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether `name` is a module or package of ours (the C++ extension included)."""
    if name == "neuronlocal._C":
        return True
    base = SRC.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of ours in the file, relative ones resolved."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((node.lineno, full if is_module(full) else base))
    return [(line, m) for line, m in out if m.split(".")[0] in ("neuronlocal", "torch_neuronx")]


FILES = sorted(p for p in SRC.rglob("*.py") if "hub_repo" not in p.parts)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_go_downward(path: Path) -> None:
    mod = module_name(path)
    own = layer_of(mod)
    upward = [f"{path.relative_to(ROOT)}:{line} imports {m} ({LAYERS[layer_of(m)][0]})"
              for line, m in imports(path) if layer_of(m) > own]
    assert not upward, f"{mod} is in layer {LAYERS[own][0]!r}; " + "; ".join(upward)


def test_core_imports_no_other_layer() -> None:
    core = [p for p in FILES if module_name(p).startswith("neuronlocal.core")]
    assert core
    for path in core:
        assert all(layer_of(m) == 0 for _, m in imports(path)), path


def test_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: an upward import (including one inside a function) is found."""
    bad = SRC / "neuronlocal" / "core" / "_layering_probe.py"
    try:
        bad.write_text("def f():\n    from neuronlocal.report import collect\n")
        assert [layer_of(m) for _, m in imports(bad)] == [layer_of("neuronlocal.report")]
        assert layer_of(module_name(bad)) == 0
    finally:
        bad.unlink()


# Inside compile/: one module per stage, lowest first. A module imports only modules of
# earlier stages (the package's __init__ sits above them all), so no import cycle can form,
# through a function-level import either.
COMPILE_STAGES = ["bucketing", "flex", "lowering", "fingerprint", "cache", "megacache", "aot",
                  "bridge", "static", "worker", "tiered", "subclass", "backend", "inductor"]
COMPILE = SRC / "neuronlocal" / "compile"


def upward_stages(path: Path, stage: int) -> list[str]:
    """Imports in `path` (at position `stage`) of compile modules not below it."""
    below = {f"neuronlocal.compile.{name}" for name in COMPILE_STAGES[:stage]}
    return [f"{path.relative_to(ROOT)}:{line} imports {m}" for line, m in imports(path)
            if (m == "neuronlocal.compile" or m.startswith("neuronlocal.compile."))
            and not any(m == b or m.startswith(b + ".") for b in below)]


def test_compile_stages_import_downward() -> None:
    stems = {p.stem for p in COMPILE.glob("*.py") if p.name != "__init__.py"}
    assert stems == set(COMPILE_STAGES), f"place each compile module in COMPILE_STAGES ({__file__})"
    found = [v for i, name in enumerate(COMPILE_STAGES)
             for v in upward_stages(COMPILE / f"{name}.py", i)]
    assert found == []


def test_stage_checker_sees_an_upward_import() -> None:
    """The stage checker itself: a function-level import of a later stage is found."""
    probe = COMPILE / "_stage_probe.py"
    try:
        probe.write_text("from neuronlocal.compile import lowering\n\n\n"
                         "def f():\n    from neuronlocal.compile.backend import neuron_backend\n")
        stage = COMPILE_STAGES.index("cache")
        assert [v.rsplit(" ", 1)[1] for v in upward_stages(probe, stage)] == [
            "neuronlocal.compile.backend"]
    finally:
        probe.unlink()


def test_architecture_doc_lists_the_layers_in_this_order() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = re.findall(r"^\|\s*(\d+)\s*\|\s*(\w+)\s*\|", doc, re.M)
    assert [(int(i), name) for i, name in table] == [
        (i, name) for i, (name, _) in enumerate(LAYERS)]


def test_neuron_h_lists_every_cpp_file() -> None:
    csrc = SRC / "neuronlocal" / "csrc"
    header = (csrc / "neuron.h").read_text()
    listed = set(re.findall(r"^//\s+(\w+\.cpp)\s", header, re.M))
    assert listed == {p.name for p in csrc.glob("*.cpp")}


CITATIONS = re.compile(r"\bspec \d+\.\d+|\[U\] in the spec|DESIGN\.md|docs/env-vars\.md"
                       r"|\b[Ii]ssue #?\d+|neuronlocal\.register\(\)|/work/shared")


def test_code_and_docs_cite_no_private_references() -> None:
    """Comments and docs state the fact or point to project docs, never to issue numbers,
    spec section numbers or files a reader of this repository cannot see."""
    roots = [SRC, ROOT / "tests", ROOT / "bench", ROOT / "tools", ROOT / "examples", ROOT / "docs"]
    files = [ROOT / "README.md"] + [p for r in roots for p in r.rglob("*")
                                    if p.suffix in (".py", ".md", ".cpp", ".h")]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files if p != Path(__file__)
             for m in CITATIONS.finditer(p.read_text())]
    assert found == []
