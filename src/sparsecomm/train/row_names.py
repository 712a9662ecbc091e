"""What a row's name says about how it reduces: PyTorch's sharded rows by name, and the prefixes of
sparsecomm's rows over several nodes. Light to import: the projections read row names too."""

from __future__ import annotations

from types import MappingProxyType

SHARDED_BASELINES = MappingProxyType({
    "torch-fsdp": "FSDP2 over every rank (fully_shard): parameters all-gathered, gradients reduce-scattered",
    "torch-hsdp": "FSDP2's hybrid sharding: sharded inside each node, shards all-reduced across nodes",
})
"""PyTorch's sharded rows, by name"""
HIERARCHICAL = "hier:"
"""a row name's prefix: its preset reduces hierarchically (`HierarchicalReducer`: dense inside each
node, compressed between nodes)"""
FSDP = "fsdp:"
"""a row name's prefix: its preset averages each node's FSDP shards across nodes (`register_fsdp_hooks`)"""
FLAT_FSDP = "fsdp-flat:"
"""a row name's prefix: FSDP2 over every rank, each module's reduce-scatter compressed by its spec
(``topk(ratio=R)+residual`` with fp values: `register_fsdp_hooks`' flat form)"""


def is_sharded(row: str) -> bool:
    """Whether the row trains under FSDP2."""
    return row in SHARDED_BASELINES or row.startswith((FSDP, FLAT_FSDP))


def preset_of(row: str) -> str:
    """The preset or spec a sparsecomm row's name carries, without its prefix."""
    for prefix in (HIERARCHICAL, FSDP, FLAT_FSDP):
        if row.startswith(prefix):
            return row.removeprefix(prefix)
    return row


def is_flat(row: str) -> bool:
    """Whether every rank of the row is a peer in one group: not hierarchical, not sharded."""
    return not row.startswith(HIERARCHICAL) and not is_sharded(row)
