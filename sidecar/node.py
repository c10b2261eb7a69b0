"""Which node this is and its rank in the run (CONTRACT 6)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

RANK_VARIABLES = ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID", "JOB_COMPLETION_INDEX")


@dataclass(frozen=True)
class Node:
    """This node's name and rank; rank 0 is the reporting node."""

    name: str
    rank: int

    @property
    def reports_lifecycle(self) -> bool:
        return self.rank == 0


def resolve_node(node_name: str | None, environ: Mapping[str, str]) -> Node:
    """--node-name, else the downward API's NODE_NAME, else the hostname; the first rank set."""
    name = node_name or environ.get("NODE_NAME") or socket.gethostname()
    rank = 0
    for var in RANK_VARIABLES:
        value = environ.get(var, "").strip()
        if value.isdigit():
            rank = int(value)
            break
    return Node(name=name, rank=rank)
