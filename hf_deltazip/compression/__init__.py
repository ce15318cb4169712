"""Compression: the OBS solver, the layer walk, calibration data and the baselines."""

from .budget import BudgetMeasurements
from .pipeline import COMPRESSION_STEPS, LayerReport, compress

__all__ = ["compress", "COMPRESSION_STEPS", "LayerReport", "BudgetMeasurements"]
