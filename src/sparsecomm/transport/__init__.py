"""Transports: how ranks exchange and sum sparse gradients on torch.distributed.

Each carries something different: ``allgather`` carries encoded payloads, ``sparse_allreduce``
(SparCML) carries sparse streams summed on the way, ``sketch_allreduce`` (S2 Reducer) carries a
linear sketch summed by a dense all_reduce, ``dense`` carries the tensor.
"""

from sparsecomm.transport import allgather, auto, dense, sketch_allreduce, sparse_allreduce

__all__ = ("allgather", "auto", "dense", "sketch_allreduce", "sparse_allreduce")
