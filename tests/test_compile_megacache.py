"""Compiled graphs as bytes (TorchNeuron's NEFF byte cache) and the `neuron_neff` MegaCache
artifact: the byte store's keys and file rules, what a compile records, save and load."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from neuronlocal.compile import megacache
from neuronlocal.core import dynamo_metrics as metrics

torch_neuronx = pytest.importorskip("torch_neuronx")
C = torch_neuronx._C


@pytest.fixture
def neff_dir(isolated_compile, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURONLOCAL_COMPILER", "eager")
    megacache.COMPILATION_CACHE.clear(persistent=False)
    yield tmp_path / "neff"
    megacache.COMPILATION_CACHE.clear(persistent=False)


def _file(root, key):
    return root / key[:2] / key[2:4] / f"{key}.neff"


def test_put_get_overwrite_and_empty(neff_dir):
    key = "0123456789abcdef0123456789abcdef"
    assert C.get_neff_cache(key) is None
    assert C.put_neff_cache(key, b"first") is True
    assert C.put_neff_cache(key, b"second") is True
    assert C.get_neff_cache(key) == b"second"
    path = _file(neff_dir, key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in (path.parent, path.parent.parent))
    C.put_neff_cache(key, b"")
    assert C.get_neff_cache(key) is None  # empty bytes are no compiled graph: a miss


@pytest.mark.parametrize("key", ["../../x1", "ab/cd/ef", "ab..cdef", ".hidden_key", "abc", "",
                                 "a" * 129, "key with spaces", 7])
def test_a_key_that_could_leave_its_folder_is_refused(neff_dir, key):
    with pytest.raises(ValueError, match="invalid NEFF cache key"):
        C.put_neff_cache(key, b"x")
    with pytest.raises(ValueError, match="invalid NEFF cache key"):
        C.get_neff_cache(key)
    assert not neff_dir.exists() or not any(neff_dir.rglob("*.neff"))


def test_links_are_never_followed(neff_dir, tmp_path):
    key = "feedfacefeedfacefeedfacefeedface"
    C.put_neff_cache(key, b"mine")
    path = _file(neff_dir, key)
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    path.unlink()
    path.symlink_to(outside)
    assert C.get_neff_cache(key) is None  # a planted link is not read through
    assert C.put_neff_cache(key, b"new") is True  # and is replaced, not written through
    assert outside.read_bytes() == b"secret" and not path.is_symlink()
    assert C.get_neff_cache(key) == b"new"


def test_a_folder_others_can_write_is_not_used(neff_dir):
    key = "abcdabcdabcdabcdabcdabcdabcdabcd"
    C.put_neff_cache(key, b"bytes")
    shard = _file(neff_dir, key).parent
    shard.chmod(0o777)
    try:
        assert C.get_neff_cache(key) is None
        assert C.put_neff_cache(key, b"other") is False
    finally:
        shard.chmod(0o700)
    assert C.get_neff_cache(key) == b"bytes"


def test_disabled_cache_writes_nothing(neff_dir, monkeypatch):
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_NEFF_CACHE", "1")
    assert C.put_neff_cache("abcdabcd", b"x") is False
    assert C.get_neff_cache("abcdabcd") is None
    assert not neff_dir.exists() or not any(neff_dir.rglob("*.neff"))


def _compile_once():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2).to("neuron")
    torch.compile(m, backend="neuron")(torch.randn(1, 4, device="neuron"))


def test_a_compile_records_the_graph_bytes_under_its_persistent_key(neff_dir):
    from torch_neuronx.neuron_dynamo_backend.compile import (
        ArtifactType,
        clear_compiled_cache_keys,
        get_compiled_cache_keys,
    )

    C._clear_compilation_cache()
    clear_compiled_cache_keys()
    _compile_once()
    (key,) = get_compiled_cache_keys(ArtifactType.NEURON_NEFF)
    pkey, data = C.get_neff_info(key)
    doc = json.loads(data)
    assert doc["cache_key"] == key and doc["compiler"] == "eager" and "linear" in doc["graph"]
    assert pkey == megacache.persistent_key(key, doc["graph"]) and len(pkey) == 32
    assert C.get_neff_cache(pkey) == data  # written to the persistent cache at compile
    assert C._get_compilation_cache_stats()["total_entries"] == 1
    assert C.get_neff_info("0" * 40) is None


def test_save_then_load_on_an_empty_cache_makes_the_graph_a_hit(neff_dir, tmp_path, monkeypatch):
    from torch.compiler._cache import CacheArtifactManager

    CacheArtifactManager.clear()
    _compile_once()
    saved, info = torch.compiler.save_cache_artifacts()
    (pkey,) = info.artifacts["neuron_neff"]
    # A fresh machine: an empty cache folder, nothing compiled in memory.
    from neuronlocal.compile.static import _CACHE

    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "fresh"))
    for loaded in (False, True):
        torch._dynamo.reset()
        metrics.reset_dynamo_metrics()
        _CACHE.memory.clear()
        C._clear_compilation_cache()
        if loaded:
            torch.compiler.load_cache_artifacts(saved)
            assert C.get_neff_cache(pkey) is not None
        _compile_once()
        caches = [g["cache"] for g in torch.neuron.get_dynamo_metrics()["graphs"]]
        assert caches == (["hit"] if loaded else ["miss"])
        CacheArtifactManager.clear()
        if not loaded:  # the miss wrote the entry and the bytes: start the fresh one again
            monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "fresh2"))


def test_stats_count_only_while_metrics_are_enabled(neff_dir):
    C._clear_compilation_cache()
    was = C._neuron_metrics_enabled()
    try:
        C._neuron_set_metrics_enabled(False)
        _compile_once()
        assert C._get_compilation_cache_stats()["persistent_misses"] == 0
        torch._dynamo.reset()
        C._neuron_set_metrics_enabled(True)
        _compile_once()  # the same graph: its bytes are in the persistent cache now
        stats = C._get_compilation_cache_stats()
        assert stats["persistent_hits"] == 1 and stats["total_entries"] == 1
    finally:
        C._neuron_set_metrics_enabled(was)
    assert os.path.isdir(neff_dir)
