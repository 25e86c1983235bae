"""The N-D parallel strategy component: process group, device mesh, tensor parallel (``parallelize_module``), FSDP2 on
the data-parallel dims (``fully_shard``, HSDP when dp_replicate > 1, with the ``parallelism_config_fsdp_*``
options) and the data-parallel topology; the optimizer swap, gradient clipping, state dicts and checkpoint items come
from the plugin API's sharded-training toolkit (:mod:`accel.spi.sharded`). torch is imported inside methods."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.spi import KernelView, LaunchPlan, Settings, Topology, UsageError, hookimpl, launch_with_torchrun
from accel.spi.sharded import ShardConfig, ShardedStrategy, shard_model
from accel_parallel import DIMS, FSDP_PREFIX, MeshPlan, cp_refusal

if TYPE_CHECKING:
    from torch import nn


class ParallelStrategy(ShardedStrategy):
    """Answers for a run on a (dp_replicate, dp_shard, cp, tp) device mesh."""

    def __init__(self, settings: Settings, plan: MeshPlan):
        super().__init__(settings)
        self.plan = plan

    # ---- launching ----------------------------------------------------------------------------------------

    @hookimpl
    def accel_launch(self, plan: LaunchPlan) -> int:
        if plan.dry_run:
            print("\n".join(self.plan.describe()))
        return launch_with_torchrun(plan, "parallel")

    # ---- process start-up ---------------------------------------------------------------------------------

    @hookimpl
    def accel_setup(self, kernel: KernelView) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.start_process_group()
        if self.plan.size("cp") > 1 and self.device.type != "cuda":
            raise UsageError(cp_refusal(self.settings, cuda=False) or "context parallel needs CUDA")
        self.mesh = init_device_mesh(self.device.type, self.plan.sizes, mesh_dim_names=DIMS)
        if self.plan.size("cp") > 1:  # FSDP shards over dp_shard and cp together (Accelerate's dp_shard_cp)
            self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")

    def context_parallel(self, buffers: list[Any], seq_dims: list[int], no_restore: set[Any]) -> Any:
        """torch's ``context_parallel`` over the ``cp`` dimension, with the configured rotate method."""
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(self.settings["parallelism_config_cp_comm_strategy"])
        return context_parallel(
            self.mesh["cp"], buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=no_restore
        )

    @hookimpl
    def accel_topology(self, kernel: KernelView) -> Topology:
        import torch.distributed as dist

        rank = dist.get_rank()
        return Topology(
            rank,
            dist.get_world_size(),
            self.local_rank,
            self.local_world,
            data_parallel_index=self.plan.dp_index(rank),
            data_parallel_size=self.plan.dp_size,
        )

    # ---- prepare ------------------------------------------------------------------------------------------

    def fsdp_mesh(self) -> Any | None:
        """The mesh FSDP2 shards over: dp_shard (and cp), with dp_replicate as HSDP's replica dim; None when the
        data-parallel dims hold one process (tensor parallel only)."""
        shard = "dp_shard_cp" if self.plan.size("cp") > 1 else "dp_shard"
        if self.plan.size("dp_replicate") > 1:
            return self.mesh["dp_replicate", shard]
        if self.plan.size("dp_shard") * self.plan.size("cp") > 1:
            return self.mesh[shard]
        return None

    def shard(self, kernel: KernelView, model: nn.Module) -> None:
        """Tensor parallel on ``tp`` (when > 1), then FSDP2 on the data-parallel dims (when they hold more than one
        process), with the ``parallelism_config_fsdp_*`` options."""
        model.to(self.device)
        if self.plan.size("tp") > 1:
            check_heads(model, self.plan.size("tp"))
            apply_tensor_parallel(model, self.mesh["tp"], tp_plan(model, self.settings["parallelism_config_tp_plan"]))
        mesh = self.fsdp_mesh()
        if mesh is not None:
            shard_model(model, ShardConfig.from_settings(self.settings, FSDP_PREFIX), mesh, self.device)


# ---- tensor parallel ----------------------------------------------------------------------------------------


def tp_plan(model: nn.Module, given: Mapping[str, str] | None) -> dict[str, str]:
    """The plan to apply: the user's, else the Hugging Face model's ``tp_plan`` (``base_model_tp_plan`` under the
    base model's prefix, plus the head's ``_tp_plan``)."""
    if given:
        return dict(given)
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not plan:
        config_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
        if config_plan:
            prefix = "" if getattr(model, "base_model", model) is model else f"{model.base_model_prefix}."
            plan = {prefix + k: v for k, v in config_plan.items()}
    if not plan:
        raise UsageError(
            f"parallelism_config_tp_size > 1, but {type(model).__name__} has no tensor-parallel plan: "
            'give one with --parallelism_config_tp_plan \'{"fc1": "colwise", "fc2": "rowwise"}\' '
            "(module-name patterns to styles)"
        )
    return dict(plan)


def check_heads(model: nn.Module, tp: int) -> None:
    """A model whose config counts attention heads (Hugging Face's ``num_attention_heads`` and
    ``num_key_value_heads``) needs a tp size that divides both: each tensor-parallel process takes whole heads.
    Refused here in one line, before attention fails on a shape."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for count, what in ((heads, "attention heads (num_attention_heads)"), (kv_heads, "key/value heads")):
        if isinstance(count, int) and not isinstance(count, bool) and count % tp:
            raise UsageError(
                f"parallelism_config tp_size={tp} does not divide the {count} {what} of {type(model).__name__}: "
                f"each tensor-parallel process takes whole heads; use a tp_size that divides {count}"
            )


def _style(name: str, style: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence": lambda: SequenceParallel(),
        "sequence_parallel": lambda: SequenceParallel(),
        "sequence_sharded_input": lambda: SequenceParallel(sequence_dim=1, use_local_output=False),
    }
    if style not in styles:
        raise UsageError(
            f"tensor-parallel plan entry {name!r}: unknown style {style!r} (known: {', '.join(sorted(styles))})"
        )
    return styles[style]()


def apply_tensor_parallel(model: nn.Module, mesh: Any, plan: Mapping[str, str]) -> None:
    """``parallelize_module`` with ``plan``; every pattern must name at least one module (a typo is an error, not a
    layer silently left whole), and each sharded dimension must divide by the tp size."""
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    names = [n for n, _ in model.named_modules() if n]
    resolved: dict[str, Any] = {}
    size = mesh.size()
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise UsageError(
                f"tensor-parallel plan entry {pattern!r} matches no module of {type(model).__name__} "
                f"(modules: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''})"
            )
        for hit in hits:
            module = model.get_submodule(hit)
            weight = getattr(module, "weight", None)
            if weight is None or weight.ndim != 2 or str(style).startswith("sequence"):
                continue
            rowwise = str(style).startswith("rowwise") or style == "embedding_rowwise"
            dim = int(rowwise) if not isinstance(module, torch.nn.Embedding) else int(not rowwise)
            if weight.shape[dim] % size:
                raise UsageError(
                    f"tensor-parallel {style} on {hit}: its weight dimension {dim} "
                    f"({weight.shape[dim]}) does not divide by tp size {size}"
                )
        resolved[pattern] = _style(pattern, str(style))
    parallelize_module(model, mesh, resolved)
