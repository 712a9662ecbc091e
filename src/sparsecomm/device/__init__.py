"""Compressed steps that stay on the device: one pass per bucket, in a fixed number of tensor ops
of fixed sizes, with no host reads but one check of the sum.

`support` says which pipelines can run so; `layout` fixes a bucket's sizes (its capacity, where
its thresholds sample); `selection` chooses a capacity's worth of entries; `feedback` proposes a
step's state and commits it once the sum is known good; `wire` packs one fixed-size buffer per
bucket and sums the ranks' buffers; `cumulative` is a running sum that deterministic algorithms
allow on a GPU.
"""
