"""This node, its rank, and whether the run spans several nodes (docs/ingest.md#nodes-and-ranks)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import NamedTuple

RANK_VARIABLES = ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID", "JOB_COMPLETION_INDEX")
NODE_COUNT_VARIABLES = ("NNODES", "SLURM_NNODES")


class Node(NamedTuple):
    """This node's name and rank; rank 0 is the reporting node."""

    name: str
    rank: int
    nodes: int | None = None  # the run's node count, when something says it

    @property
    def reports_lifecycle(self) -> bool:
        """Rank 0 alone posts lifecycle events."""
        return self.rank == 0

    @property
    def reports_environment(self) -> bool:
        """Rank 0 alone posts /environment."""
        return self.rank == 0

    @property
    def multi_node(self) -> bool:
        """More than one node, by count or because this node's rank is above 0."""
        return (self.nodes or 1) > 1 or self.rank > 0


def resolve_node(node_name: str | None, environ: Mapping[str, str],
                 nodes: int | None = None) -> Node:
    """--node-name, else the downward API's NODE_NAME, else the hostname; the first rank set;
    --nodes, else the first node count the environment gives."""
    name = node_name or environ.get("NODE_NAME") or socket.gethostname()
    rank = next((v for v in (_count(environ, var) for var in RANK_VARIABLES) if v is not None), 0)
    return Node(name=name, rank=rank, nodes=nodes or node_count(environ))


def node_count(environ: Mapping[str, str]) -> int | None:
    """NNODES, SLURM_NNODES, else WORLD_SIZE / LOCAL_WORLD_SIZE (processes over processes per
    node); None when none of them is set to a positive whole number."""
    for var in NODE_COUNT_VARIABLES:
        count = _count(environ, var)
        if count:
            return count
    world = _count(environ, "WORLD_SIZE")
    local = _count(environ, "LOCAL_WORLD_SIZE")
    if world and local:
        return max(1, -(-world // local))
    return None


def _count(environ: Mapping[str, str], var: str) -> int | None:
    value = environ.get(var, "").strip()
    return int(value) if value.isdigit() else None
