"""``accelerate.test_utils`` under its accel path: the generic test helpers of :mod:`accel.testing.regression`
(``RegressionDataset``, ``RegressionModel``, ``assert_exception``) where Accelerate's scripts import them."""

from __future__ import annotations

from accel.testing.regression import RegressionDataset, RegressionModel, assert_exception

__all__ = ["RegressionDataset", "RegressionModel", "assert_exception"]
