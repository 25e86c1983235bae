"""accel-plugin-parallel with pipeline parallelism runs the strategy conformance kit: ``strategy_check --model
pipeline`` (a two-layer ``layers`` stack) on 2 real processes with ``--parallelism_config_pp_size 2`` (one stage
each, dp 1), checked by :func:`accel.testing.conformance.check_pipeline_training` against full-batch gradient
descent on one process."""

from __future__ import annotations

from accel.testing.conformance import StrategyConformance


class TestParallelPipelineConformance(StrategyConformance):
    name = "parallel"
    model = "pipeline"
    launch_args = ("--parallelism_config_pp_size", "2")
