"""Sparsifiers: each turns a dense tensor into a `SparseGradient` of the entries to send."""

from sparsecomm.sparsify import (
    adaptive,
    block_topk,
    bucketed_topk,
    dgc_threshold,
    nonzero,
    randomk,
    threshold,
    topk,
)

__all__ = ["adaptive", "block_topk", "bucketed_topk", "dgc_threshold", "nonzero", "randomk", "threshold", "topk"]
