"""The library's error types. Every error sparsecomm raises on bad input is a ValueError subclass."""

from __future__ import annotations


class SparseCommError(ValueError):
    """Base class: bad input, bad configuration, or a payload that cannot be trusted.

    Raised on its own for what is neither a spec nor a payload: torch.distributed not initialised,
    ranks that disagree on what they reduce, a value a codec cannot carry; a non-finite gradient
    under ``nonfinite="raise"`` raises its subclass `NonFiniteError`. Where one rank meets such an
    error inside a collective, every rank raises it at the same call.

    Example:
        ```python
        import sparsecomm as sc

        try:
            sc.GradientReducer("dgc")  # outside a torch.distributed job
        except sc.SparseCommError as err:
            print(err)
        ```
    """


class NonFiniteError(SparseCommError):
    """A call's sum is non-finite on every rank — a rank's gradient held a NaN or Inf, or the sum
    overflowed — and no rank applied it: what every rank raises under ``nonfinite="raise"`` (under
    ``"propagate"`` the call's average is NaN instead).

    Example:
        ```python ranks=2
        import torch
        import torch.distributed as dist

        import sparsecomm as sc

        with sc.GradientReducer("topk(ratio=0.05)+residual+rice+fp32") as reducer:
            gradient = torch.ones(100, 100)
            if dist.get_rank() == 1:
                gradient[0, 0] = float("nan")
            try:
                reducer.allreduce_([("w", gradient)])
            except sc.NonFiniteError as err:
                print(err)  # on every rank: a rank had a non-finite gradient (NaN or Inf) in 'w'; ...
        ```
    """


class SpecError(SparseCommError):
    """A pipeline spec string or component name/parameter is invalid; the message lists the valid
    names or parameters.

    Example:
        ```python
        import sparsecomm as sc

        try:
            sc.parse_spec("topk(ratio=0.01,bucket=4)")
        except sc.SpecError as err:
            print(err)  # sparsifier 'topk' has no parameter 'bucket'; parameters: ratio, k, warmup
        ```
    """


class PayloadError(SparseCommError):
    """A payload is truncated, corrupted, of another format version, or internally inconsistent.

    Example:
        ```python
        import torch

        import sparsecomm as sc

        payload = sc.encode(sc.SparseGradient.from_dense(torch.tensor([0.0, 1.5, 0.0])))
        try:
            sc.decode(payload[:-1])
        except sc.PayloadError as err:
            print(err)  # payload is ... bytes but its header describes ... (truncated?)
        ```
    """
