"""What a reducer sent and how long its stages took, per stream and in all."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TensorStats:
    """Totals for one tensor or bucket since the reducer started (or was loaded)."""

    steps: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    select_s: float = 0.0
    transport_s: float = 0.0
    decode_s: float = 0.0
    route: str = ""
    """the route its last call took (`Route`)"""

    @property
    def compression_ratio(self) -> float:
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("inf")


@dataclass
class ReducerStats:
    """Per stream (a tensor's name, or a DDP bucket's) and the steps finished."""

    tensors: dict[str, TensorStats] = field(default_factory=dict)
    steps: int = 0

    @property
    def bytes_sent(self) -> int:
        return sum(t.bytes_sent for t in self.tensors.values())

    @property
    def dense_bytes(self) -> int:
        return sum(t.dense_bytes for t in self.tensors.values())

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("inf")

    def summary(self) -> dict[str, float]:
        return {
            "steps": self.steps, "bytes_sent": self.bytes_sent, "bytes_per_step": self.bytes_per_step,
            "compression_ratio": self.compression_ratio,
            "select_s": sum(t.select_s for t in self.tensors.values()),
            "transport_s": sum(t.transport_s for t in self.tensors.values()),
            "decode_s": sum(t.decode_s for t in self.tensors.values()),
        }
