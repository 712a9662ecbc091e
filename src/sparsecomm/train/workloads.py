"""Every training workload by name. None downloads anything at run time: their data ships with a
package (scikit-learn's digits) or with Python (the standard library's sources and docstrings)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from sparsecomm.errors import SparseCommError
from sparsecomm.train.cnn import DigitsResNet
from sparsecomm.train.digits import Digits
from sparsecomm.train.gpt import LARGE, StdlibGPT
from sparsecomm.train.lm import StdlibLanguageModel

Workload = Digits | StdlibLanguageModel | StdlibGPT | DigitsResNet
WORKLOADS: Mapping[str, Callable[[], Workload]] = MappingProxyType({
    "digits": Digits, "cnn": DigitsResNet, "lm": StdlibLanguageModel, "gpt": StdlibGPT,
    "gpt-large": lambda: StdlibGPT(LARGE, name="gpt-large", default_batch=32, ddp_bucket_mb=None),
})
"""every workload by name: how to build it"""


def workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise SparseCommError(f"unknown workload {name!r}; available: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]()
