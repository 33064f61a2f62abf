"""TorchNeuron's profiler on neuronlocal: the runtime inspect calls (`torch_neuronx._C`'s
`_nrt_inspect_*`, statuses as the runtime returns them), `NeuronProfiler`'s errors, and the
framework mapping of the ops executed on neuron while both sides profile."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity

import torch_neuronx
from torch_neuronx import _C
from torch_neuronx.profiling import NeuronProfiler, NRTProfilerError


def _config(tmp_path):
    config = _C._nrt_inspect_config_allocate()
    assert _C._nrt_inspect_config_set_defaults(config) == 0
    assert _C._nrt_inspect_config_set_output_dir(config, str(tmp_path / "nrt")) == 0
    return config


def test_inspect_session_statuses(tmp_path):
    config = _config(tmp_path)
    assert _C._nrt_inspect_begin_with_options(config) != 0  # inspect not enabled
    assert _C._nrt_inspect_config_set_enable_inspect(config, True) == 0
    assert _C._nrt_inspect_config_set_capture_enabled_for_nc(config, 4, True) == 0
    assert _C._nrt_inspect_config_set_capture_enabled_for_nc(config, -1, True) != 0
    assert _C._nrt_inspect_config_set_capture_enabled_for_event_type_string(config, " ", True) != 0
    assert _C._nrt_inspect_stop() != 0  # nothing begun
    assert _C._nrt_inspect_begin_with_options(config) == 0
    assert (tmp_path / "nrt").is_dir()
    assert _C._nrt_inspect_begin_with_options(config) != 0  # one session at a time
    assert _C._nrt_inspect_stop() == 0


def test_nested_profiler_is_an_nrt_error(tmp_path):
    with NeuronProfiler(neuron_output_dir=str(tmp_path)):
        inner = NeuronProfiler(neuron_output_dir=str(tmp_path))
        with pytest.raises(NRTProfilerError, match="Failed to start NRT profiling. Status: 2"):
            inner.start()
        assert not inner.is_active()
    # the outer session ended: a new one starts
    with NeuronProfiler(neuron_output_dir=str(tmp_path)) as prof:
        assert prof.is_active()


def test_event_filters_reach_the_session(tmp_path):
    with NeuronProfiler(neuron_output_dir=str(tmp_path),
                        event_filters={"nc": ["0", "4-6", "9-7"], "types": ["nrt_model_switch"]}):
        from torch_neuronx import _nrt_inspect

        session = _nrt_inspect.active_session()
        assert session is not None
        assert session.cores == {0, 4, 5, 6}
        assert session.event_types == {"nrt_model_switch"}


def _mapping_files(tmp_path):
    return sorted(tmp_path.glob("framework_mapping_*.json"))


def test_framework_mapping_lists_each_op_executed_on_neuron(tmp_path):
    x = torch.ones(8, 8, device="neuron")
    with NeuronProfiler(pytorch_activities=[ProfilerActivity.CPU],
                        neuron_output_dir=str(tmp_path)):
        torch_neuronx.clear_op_tracking()
        y = torch.relu(torch.mm(x, x))
        torch.add(y, y)
        executed = torch_neuronx.get_executed_ops()
    assert (tmp_path / "pytorch_trace.json").exists()
    (path,) = _mapping_files(tmp_path)
    mapping = json.loads(path.read_text())
    assert mapping["version"] == 1
    seq = [e["nrta_seq_id"] for e in mapping["data"]]
    assert seq == sorted(seq) and len(set(seq)) == len(seq)
    # mm, relu, add (and the outputs' allocations): at least one execution each
    assert len(seq) >= 3
    assert len(seq) <= sum(executed.values())
    for entry in mapping["data"]:
        (op,) = entry["framework_op_exec_ids"]
        assert set(op) == {"seq_nr", "th_id", "stream_id"}
        assert op["stream_id"] == torch.neuron.current_stream().stream_id


def test_framework_mapping_needs_both_sides(tmp_path):
    x = torch.ones(4, 4, device="neuron")
    with NeuronProfiler(neuron_output_dir=str(tmp_path)):  # runtime side only
        torch.mm(x, x)
    assert _mapping_files(tmp_path) == []
    torch.mm(x, x)  # mapping off: nothing recorded
    assert _C._get_profiler_mappings()["data"] == []


def test_allocator_submodule_empties_the_cache():
    x = torch.empty(1 << 20, device="neuron")
    del x
    before = torch_neuronx.memory_reserved()
    assert before > 0
    _C.NeuronCachingAllocator.emptyCache()
    assert torch_neuronx.memory_reserved() < before
    assert _C.NeuronCachingAllocator.get() is not None
