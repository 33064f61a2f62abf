"""The link class of a collective's group comes from its member ranks, not its size.

trn2.48xlarge at LNC=2: 4 logical cores per chip, 64 per instance. TP over consecutive
ranks inside FSDP (or DDP) over the ranks strided by the TP degree, on one and two
instances, as torchrun numbers the ranks and `init_device_mesh(..., (dp, tp))` groups them.
"""

from __future__ import annotations

import pytest

from neuronlocal.core.topology import consecutive, link_class

CHIP, NODE = 4, 64  # trn2.48xlarge, LNC=2


def _mesh_groups(world: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(TP groups, data-parallel groups) of a (world // tp, tp) mesh, as init_device_mesh
    builds them: TP over consecutive ranks, data parallel strided by tp."""
    tps = [list(range(s, s + tp)) for s in range(0, world, tp)]
    dps = [list(range(r, world, tp)) for r in range(tp)]
    return tps, dps


@pytest.mark.parametrize(("world", "tp", "tp_link", "dp_link"), [
    (64, 4, "same chip", "NeuronLink"),  # Qwen3-8B's TP=4 x FSDP=16 on one instance
    (64, 8, "NeuronLink", "NeuronLink"),
    (16, 4, "same chip", "NeuronLink"),  # both groups of 4 ranks, on different links
    (128, 8, "NeuronLink", "EFA"),  # Llama-3-70B's TP=8 x FSDP=16 on two instances
    (128, 64, "NeuronLink", "EFA"),  # TP over a whole instance, data parallel across two
    (128, 4, "same chip", "EFA"),
])
def test_tp_inside_fsdp_groups_take_their_members_links(world, tp, tp_link, dp_link):
    tps, dps = _mesh_groups(world, tp)
    assert {link_class(g, CHIP, NODE) for g in tps} == {tp_link}
    assert {link_class(g, CHIP, NODE) for g in dps} == {dp_link}


def test_a_strided_group_differs_from_as_many_consecutive_ranks():
    """FSDP's 16 ranks strided by 8 span two instances; 16 consecutive ranks share one."""
    strided = list(range(0, 128, 8))
    assert link_class(strided, CHIP, NODE) == "EFA"
    assert consecutive(len(strided), CHIP, NODE) == "NeuronLink"
    # 4 ranks strided by 2 still span 2 chips; 2 strided by 2 stay on one
    assert link_class([0, 2, 4, 6], CHIP, NODE) == "NeuronLink"
    assert link_class([1, 3], CHIP, NODE) == "same chip"


def test_fewer_ranks_per_node_than_cores_and_trivial_groups():
    """--nproc-per-node 8 on trn2.48xlarge: ranks 8..15 are on the second instance."""
    assert link_class([0, 8], CHIP, 8) == "EFA"
    assert link_class([8, 9, 10, 11], CHIP, 8) == "same chip"
    assert link_class([8, 12], CHIP, 8) == "NeuronLink"
    assert link_class([5], CHIP, NODE) == link_class([], CHIP, NODE) == "none"
    assert link_class([3, 3], CHIP, NODE) == "none"


def test_consecutive_groups_keep_the_size_rule():
    """A layout known by sizes alone (neuronlocal estimate): same chip up to a chip's
    cores, NeuronLink up to an instance's, EFA beyond."""
    assert [consecutive(n, CHIP, NODE) for n in (1, 2, 4, 5, 64, 65, 128)] == [
        "none", "same chip", "same chip", "NeuronLink", "NeuronLink", "EFA", "EFA"]


def test_bad_topology_is_refused_with_its_numbers():
    with pytest.raises(ValueError, match=r"cores_per_chip \(0\)"):
        link_class([0, 1], 0, NODE)
