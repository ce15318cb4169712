"""Compression: the OBS solver, the layer walk, calibration data and the baselines."""

from .pipeline import compress

__all__ = ["compress"]
