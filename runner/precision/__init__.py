"""Precision plugins: how the model is built, cast, run forward, and how gradients reach the optimizer."""

from runner.precision.double import DoublePrecision
from runner.precision.half import HalfPrecision
from runner.precision.mixed import MixedPrecision
from runner.precision.precision import Precision

__all__ = ["DoublePrecision", "HalfPrecision", "MixedPrecision", "Precision"]
