"""A custom loop step's (name, gradient) pairs, in the order every rank reduces them (by name), and
the agreements of a step and of `GradientReducer.suit_optimizer`: what is wrong on one rank is
refused there, so every rank raises at the agreement, where raising alone would leave the others
waiting in it. And the check of named tensors laid out in one flat buffer (`check_segments`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from sparsecomm.errors import SparseCommError
from sparsecomm.pipeline import Segment
from sparsecomm.spec import PipelineSpec, format_spec
from sparsecomm.transport.agreement import agree
from sparsecomm.transport.collectives import fingerprint
from sparsecomm.transport.request import Request

Named = list[tuple[str, Any]]
"""(name, gradient) pairs sorted by name; a gradient may be anything until `problem` has passed it"""


def by_name(named_gradients: Iterable[tuple[str, Any]]) -> Named:
    """A step's (name, gradient) pairs sorted by name, the order every rank reduces them in."""
    return sorted(named_gradients, key=lambda item: item[0])


def problem(named: Named) -> str:
    """What is wrong with a step's pairs on this rank ("" where nothing is): a name that repeats, a
    gradient that is missing (None) or not a floating-point tensor, or one that requires grad or is
    expanded (the average is written into it in place)."""
    repeated = sorted(name for name, count in Counter(name for name, _ in named).items() if count > 1)
    if repeated:
        return f"gradient names repeat: {repeated}"
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            return (f"{name!r} has no gradient ({type(tensor).__name__}): every rank passes the same named "
                    "gradients (a parameter unused in this step has none)")
        if not tensor.is_floating_point():
            return f"{name!r}: gradients are floating point, not {tensor.dtype}"
        if tensor.requires_grad:
            return f"{name!r} requires grad: pass its .grad (or detach it), which is averaged in place"
        if not tensor.is_sparse and any(stride == 0 and size > 1
                                        for stride, size in zip(tensor.stride(), tensor.shape, strict=True)):
            return f"{name!r} is expanded (entries share memory): the average cannot be written into it; clone() it"
    return ""


def check_segments(segments: tuple[Segment, ...], numel: int) -> None:
    """Raise `SparseCommError` unless ``segments`` lay out a flat buffer of ``numel`` entries: in
    order, each starting where the one before ended, together covering it, each name once (else a
    name's state would take two tensors' entries, or entries no name holds would go unsent)."""
    end, names = 0, set[str]()
    for segment in segments:
        if segment.start != end or segment.numel < 0 or segment.key in names:
            raise SparseCommError(f"segment {segment.key!r} at {segment.start} (of {segment.numel}) does not follow "
                                  f"the last, which ended at {end}, or its name repeats: segments lay the buffer out "
                                  "in order, each name once")
        end += segment.numel
        names.add(segment.key)
    if end != numel:
        raise SparseCommError(f"the segments cover {end} entries of a buffer of {numel}")


def travels(named: Named, dtypes: bool = False) -> int:
    """A fingerprint of how each gradient travels, which every rank must share: dense or sparse (the
    two take different routes), its sparse dimensions, and with ``dtypes`` its dtype and device."""
    return fingerprint(*((name, tensor.is_sparse, tensor.sparse_dim() if tensor.is_sparse else 0)
                         + ((str(tensor.dtype), tensor.device.type) if dtypes else ()) for name, tensor in named))


def agree_on_step(group: dist.ProcessGroup | None, named: Named, call: int, numel: int, layout: int,
                  refused: str = "") -> None:
    """The step's agreement: every rank passes the same names, ``numel`` and ``layout`` (`travels`),
    and none refused its pairs (``refused``). Raises `SparseCommError` on every rank otherwise — on
    a refusing rank, with its reason."""
    names = [name for name, _ in named]
    _agree_or_refuse(group, Request(key="gradients " + ", ".join(names), call=call, refused=refused), numel, layout)


def agree_on_suited(group: dist.ProcessGroup | None, spec: PipelineSpec, refused: str = "") -> None:
    """`GradientReducer.suit_optimizer`'s agreement: every rank goes on with one pipeline, whether
    its own changed or not (ranks given different optimizers differ here), and none refused the
    change (``refused``). Raises `SparseCommError` on every rank otherwise."""
    _agree_or_refuse(group, Request(key="GradientReducer.suit_optimizer", refused=refused), 1,
                     fingerprint(format_spec(spec)))


def _agree_or_refuse(group: dist.ProcessGroup | None, request: Request, numel: int, config: int) -> None:
    """`agree`, which a refusing rank (``request.refused``) leaves with its own reason."""
    try:
        agree(group, request, numel, 0 if request.refused else config)
    except SparseCommError as err:
        if request.refused:
            raise SparseCommError(request.refused) from err
        raise
