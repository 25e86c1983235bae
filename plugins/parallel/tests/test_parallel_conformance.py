"""accel-plugin-parallel with pipeline parallelism runs the strategy conformance kit: ``strategy_check --model
pipeline`` (a four-layer ``layers`` stack) on 2 real processes with ``--parallelism_config_pp_size 2`` (one stage
each, dp 1), checked by :func:`accel.testing.conformance.check_pipeline_training` against full-batch gradient
descent on one process; and, on 4 processes (training only), pp=2 x dp_shard=2, pp=4 (a layer per stage) and
pp=2 x tp=2 (the stack's ``_tp_plan``). Measured: about 10 s for pp=2, 13 s for each 4-process class."""

from __future__ import annotations

from accel.testing.conformance import StrategyConformance


class TestParallelPipelineConformance(StrategyConformance):
    name = "parallel"
    model = "pipeline"
    launch_args = ("--parallelism_config_pp_size", "2")
    real_launch_counts = (2, 4)  # the launches' process counts: a multiple of pp


class TestParallelPipelineShardedConformance(TestParallelPipelineConformance):
    """pp=2 x dp_shard=2 on 4 processes: the data is sharded over the 2 data-parallel shards, and the two replicas
    of each stage (FSDP2-sharded) are compared per micro-batch. Only the training check (the others are the pp=2
    class's)."""

    num_processes = 4
    launch_args = ("--parallelism_config_pp_size", "2", "--parallelism_config_dp_shard_size", "2")
    # the plugin-level checks ran above (the launch-settings probes launch 2 processes, which a 4-process mesh
    # refuses by its size): not collected again here
    test_every_launch_setting_is_honoured_or_refused = None  # type: ignore[assignment]
    test_a_real_launch_carries_out_the_plan = None  # type: ignore[assignment]
    test_listed_by_accel_plugins = None  # type: ignore[assignment]
    test_entry_point_module_is_cheap = None  # type: ignore[assignment]


class TestParallelPipelineFourStagesConformance(TestParallelPipelineShardedConformance):
    """pp=4 on 4 processes: one layer of the stack per stage (training only, as above)."""

    launch_args = ("--parallelism_config_pp_size", "4")


class TestParallelPipelineTensorParallelConformance(TestParallelPipelineShardedConformance):
    """pp=2 x tp=2 on 4 processes: each stage's colwise/rowwise pair is split over 2 processes (training only)."""

    launch_args = ("--parallelism_config_pp_size", "2", "--parallelism_config_tp_size", "2")
