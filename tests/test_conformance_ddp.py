"""accel-plugin-ddp runs the strategy conformance suite of accel.testing (two real processes over gloo)."""

from __future__ import annotations

from accel.testing.conformance import StrategyConformance


class TestDDPConformance(StrategyConformance):
    name = "ddp"
