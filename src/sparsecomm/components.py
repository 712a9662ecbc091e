"""Every built-in component, loaded here and nowhere else (importing ``sparsecomm`` loads this module,
so the registries are full before any spec is parsed or payload decoded). The classes are importable
from here for IDE users: ``from sparsecomm.components import TopK, RiceIndices``, and so are the base
classes a new component derives from (`Sparsifier`, `CountedSparsifier`, `Feedback`, `IndexCodec`,
`ValueCodec`, `Transport`)."""

from __future__ import annotations

from sparsecomm.encode.base import IndexCodec, ValueCodec
from sparsecomm.encode.index.bitmap import BitmapIndices
from sparsecomm.encode.index.bloom import BloomIndices
from sparsecomm.encode.index.delta_binary import DeltaBinaryIndices
from sparsecomm.encode.index.huffman import HuffmanIndices
from sparsecomm.encode.index.packed import PackedIndices
from sparsecomm.encode.index.raw import RawIndices
from sparsecomm.encode.index.rice import RiceIndices
from sparsecomm.encode.index.rle import RunLengthIndices
from sparsecomm.encode.joint.skcompress import SKCompress
from sparsecomm.encode.value.deflate import DeflateValues
from sparsecomm.encode.value.dexp import DoubleExponentialValues
from sparsecomm.encode.value.floats import BFloat16Values, Float16Values, Float32Values
from sparsecomm.encode.value.int8 import Int8Values
from sparsecomm.encode.value.polyfit import PolyfitValues
from sparsecomm.encode.value.qsgd import QSGDValues
from sparsecomm.encode.value.zstd import ZstdValues
from sparsecomm.feedback.base import Feedback
from sparsecomm.feedback.dgc_momentum import DGCMomentum
from sparsecomm.feedback.none import NoFeedback
from sparsecomm.feedback.residual import Residual
from sparsecomm.sparsify.adaptive import Adaptive
from sparsecomm.sparsify.base import CountedSparsifier, Sparsifier
from sparsecomm.sparsify.block_topk import BlockTopK
from sparsecomm.sparsify.bucketed_topk import BucketedTopK
from sparsecomm.sparsify.dgc_threshold import DGCThreshold
from sparsecomm.sparsify.nonzero import Nonzero
from sparsecomm.sparsify.randomk import RandomK
from sparsecomm.sparsify.threshold import Threshold
from sparsecomm.sparsify.topk import TopK
from sparsecomm.transport.allgather import AllgatherTransport
from sparsecomm.transport.auto import AutoTransport
from sparsecomm.transport.base import Transport
from sparsecomm.transport.dense import DenseTransport
from sparsecomm.transport.sketch_allreduce import SketchAllreduce
from sparsecomm.transport.sparse_allreduce import SparseAllreduce

__all__ = [
    "Adaptive",
    "AllgatherTransport",
    "AutoTransport",
    "BFloat16Values",
    "BitmapIndices",
    "BlockTopK",
    "BloomIndices",
    "BucketedTopK",
    "CountedSparsifier",
    "DGCMomentum",
    "DGCThreshold",
    "DeflateValues",
    "DeltaBinaryIndices",
    "DenseTransport",
    "DoubleExponentialValues",
    "Feedback",
    "Float16Values",
    "Float32Values",
    "HuffmanIndices",
    "Int8Values",
    "IndexCodec",
    "NoFeedback",
    "Nonzero",
    "PackedIndices",
    "PolyfitValues",
    "QSGDValues",
    "RandomK",
    "RawIndices",
    "Residual",
    "RiceIndices",
    "RunLengthIndices",
    "SKCompress",
    "SketchAllreduce",
    "SparseAllreduce",
    "Sparsifier",
    "Threshold",
    "TopK",
    "Transport",
    "ValueCodec",
    "ZstdValues",
]
