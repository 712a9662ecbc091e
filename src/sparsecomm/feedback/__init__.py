"""Feedback: what a pipeline keeps locally between steps (residuals; DGC momentum comes later)."""

from sparsecomm.feedback import none, residual

__all__ = ["none", "residual"]
