"""Feedback: what a pipeline keeps locally between steps (residuals, DGC momentum)."""

from sparsecomm.feedback import dgc_momentum, none, residual

__all__ = ["dgc_momentum", "none", "residual"]
