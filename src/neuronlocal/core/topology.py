"""Which link a collective's traffic crosses, from its group's member ranks.

torchrun numbers ranks node by node (rank r is on node r // ranks_per_node) and each rank
binds to the logical core of its local rank, so core (r % ranks_per_node) sits on chip
((r % ranks_per_node) // cores_per_chip). A group whose members share one chip exchanges
through that chip's HBM, one whose members share a node crosses NeuronLink, and one that
spans nodes crosses EFA. The member ranks decide, not the group's size: FSDP over the data
dimension with TP inside (ranks r, r + tp, r + 2 tp, ...) spans chips, or nodes, that a
group of as many consecutive ranks would not. The collective recorder
(distributed/backend.py) and the estimator (estimate/counting.py) both call `link_class`.
"""

from __future__ import annotations

from collections.abc import Iterable

from neuronlocal.core.counters import launcher_count

NONE, SAME_CHIP, NEURONLINK, EFA = "none", "same chip", "NeuronLink", "EFA"


def link_class(ranks: Iterable[int], cores_per_chip: int, ranks_per_node: int) -> str:
    """The link class of a group with these global `ranks`: "none" (one rank), "same chip",
    "NeuronLink" (chips of one node) or "EFA" (more than one node)."""
    members = set(ranks)
    if cores_per_chip < 1 or ranks_per_node < 1:
        raise ValueError(f"link_class: cores_per_chip ({cores_per_chip}) and ranks_per_node "
                         f"({ranks_per_node}) must be at least 1")
    if len(members) <= 1:
        return NONE
    if len({r // ranks_per_node for r in members}) > 1:
        return EFA
    if len({(r % ranks_per_node) // cores_per_chip for r in members}) > 1:
        return NEURONLINK
    return SAME_CHIP


def consecutive(group_size: int, cores_per_chip: int, ranks_per_node: int) -> str:
    """The link class of `group_size` consecutive ranks from rank 0 (a layout given by sizes
    alone, such as `neuronlocal estimate`'s)."""
    return link_class(range(group_size), cores_per_chip, ranks_per_node)


def ranks_per_node(total_cores: int) -> int:
    """Ranks on each node: torchrun's LOCAL_WORLD_SIZE, else every logical core of one."""
    return launcher_count("LOCAL_WORLD_SIZE", 0, minimum=1) or total_cores


def of_ranks(ranks: Iterable[int]) -> str:
    """`link_class` of these global ranks on the emulated instance, with this job's ranks per
    node."""
    from neuronlocal.core import state

    prof = state.profile
    return link_class(ranks, prof.cores_per_chip, ranks_per_node(prof.total_cores))
