"""Presets: the five seed systems (and the dense baseline) as pipeline specs with their papers'
defaults. A preset whose components are not built yet says so instead of silently degrading."""

from __future__ import annotations

from dataclasses import dataclass

from sparsecomm.errors import SpecError
from sparsecomm.registry import kind_of
from sparsecomm.spec import PipelineSpec, parse_spec, split_stages


@dataclass(frozen=True)
class Preset:
    """A named pipeline: its ``spec`` string, what it does (``description``) and the paper it
    follows (``source``)."""

    spec: str
    description: str
    source: str


PRESETS: dict[str, Preset] = {
    "dense": Preset("nonzero+none+raw+fp32+dense", "plain fp32 all_reduce: the baseline", "—"),
    "dgc": Preset(
        "dgc(ratio=0.001)+dgc_momentum(momentum=0.9)+rle+fp32+allgather",
        "99.9% sparsity by sampled threshold, momentum correction and factor masking, 32-bit values with "
        "16-bit zero-run lengths, gathered; optimizer: SGD without momentum. Add warmup=STEPS to dgc(...) "
        "for the exponential warm-up and clip=NORM to dgc_momentum(...) for local clipping",
        "Deep Gradient Compression (Lin et al., ICLR 2018)",
    ),
    "deepreduce": Preset(
        "topk(ratio=0.01)+residual+bloom(policy=p2)+polyfit+allgather",
        "top-1% with Bloom-filter indices (conflict-set policy P2) and polynomial-fit values",
        "DeepReduce (Xu et al., NeurIPS 2021)",
    ),
    "deepreduce-qsgd": Preset(
        "topk(ratio=0.01)+residual+bloom(policy=p0)+qsgd(bits=8,bucket=512)+allgather",
        "top-1% with Bloom-filter indices (policy P0) and 7-bit-magnitude QSGD values in buckets of 512",
        "DeepReduce (Xu et al., NeurIPS 2021)",
    ),
    "skcompress": Preset(
        "topk(ratio=0.01)+residual+skcompress(groups=128)+allgather",
        "quantile-bucket values, grouped MinMaxSketch, Huffman-coded sketch and delta-binary keys; 128 groups of "
        "two bins where SketchML's code has 8 of 32: a collision shrinks a value by at most its group's span, and "
        "on lm's output layer that cut the codec's error from 35% to 10% of the selection for 3% more bytes",
        "SKCompress (Jiang et al., VLDB Journal 2020)",
    ),
    "s2": Preset(
        "block_topk(ratio=0.03125,block=256)+residual+raw+fp32+sketch_allreduce(ratio=1.3,rows=3,block=32,decode=peel)",
        "1/32 of the blocks by L2 norm, summed as a three-row count sketch plus a bitmap of 32-entry blocks by dense "
        "all_reduce, the marked entries solved exactly by peeling (the paper reads them as medians at λ = 0.5, whose "
        "noise does not converge here: sketch_allreduce(ratio=0.5,block=32)); entries left unsolved stay in the "
        "error feedback",
        "S2 Reducer (Ge et al., 2021)",
    ),
    "adaptive": Preset(
        "adaptive+dgc_momentum(masking=false,nesterov=true)+rice+int8+allgather",
        "dense (exact) where the link carries the whole gradient while the step computes or it costs no more, "
        "else the largest entries at the density that moves the most gradient energy per second of step, with "
        "near-entropy (Rice) indices, 8-bit values and Nesterov momentum correction (no masking: at a few percent "
        "density it would discard most momentum); from measured compute time, link throughput and the gradient's "
        "own energy curve. Optimizer: SGD without momentum; for other optimizers use "
        "adaptive+residual+rice+int8+allgather (check_optimizer switches to it), whose compressed steps under AdamW "
        "and its kin go low-rank, as PowerSGD's products of rank 8",
        "ours (DGC's momentum correction, SparCML's sparse/dense switch)",
    ),
    "sparcml": Preset(
        "bucketed_topk(k=16,bucket=512)+residual+raw+fp32+sparse_allreduce(algorithm=auto,qsgd_bits=4,bucket=1024)",
        "top 16 of every 512 entries with error feedback; sparse allreduce switching to a dense, 4-bit QSGD phase",
        "SparCML (Renggli et al., SC 2019)",
    ),
}
"""Every preset by name: a `Preset` with its ``spec`` string, a ``description`` and its ``source``.
A preset's name goes wherever a spec string does (`GradientReducer`, `register_ddp_hook`,
``sparsecomm train --presets``); `available_presets` lists those this installation can build.

Example:
    ```python
    import sparsecomm as sc

    print(sc.PRESETS["dgc"].spec)    # dgc(ratio=0.001)+dgc_momentum(momentum=0.9)+rle+fp32+allgather
    pipe = sc.Pipeline(sc.PRESETS["deepreduce-qsgd"].spec)
    print(pipe, "—", sc.PRESETS["deepreduce-qsgd"].source)
    ```
"""


def missing_components(spec: str) -> list[str]:
    return [name for name, _ in split_stages(spec) if kind_of(name) is None]


def resolve(spec_or_preset: str | PipelineSpec) -> PipelineSpec:
    """A preset name or a spec string → the pipeline it names."""
    if isinstance(spec_or_preset, PipelineSpec):
        return spec_or_preset
    preset = PRESETS.get(spec_or_preset)
    if preset is None:
        return parse_spec(spec_or_preset)
    missing = missing_components(preset.spec)
    if missing:
        raise SpecError(f"preset {spec_or_preset!r} needs {', '.join(missing)}, which this sparsecomm does not "
                        f"have yet; available presets: {', '.join(available_presets())}")
    return parse_spec(preset.spec)


def available_presets() -> list[str]:
    """The names of the presets whose components this installation has, in `PRESETS` order.

    Returns:
        Preset names, each usable wherever a spec string goes.

    Example:
        ```python
        import sparsecomm as sc

        for name in sc.available_presets():
            print(f"{name:16} {sc.PRESETS[name].description[:60]}")
        ```
    """
    return [name for name, preset in PRESETS.items() if not missing_components(preset.spec)]
