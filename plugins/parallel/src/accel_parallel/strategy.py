"""The N-D parallel strategy component: process group, device mesh, tensor parallel (``parallelize_module``), FSDP2 on
the data-parallel dims (``fully_shard``, HSDP when dp_replicate > 1, with the ``parallelism_config_fsdp_*``
options) and the data-parallel topology; the optimizer swap, gradient clipping, state dicts and checkpoint items come
from the plugin API's sharded-training toolkit (:mod:`accel.spi.sharded`). torch is imported inside methods."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from accel.spi import KernelView, LaunchPlan, Settings, Topology, UsageError, hookimpl, launch_with_torchrun
from accel.spi.sharded import ShardConfig, ShardedStrategy, checkpoint_layers, clip_grad_norm, shard_model
from accel_parallel import AC_OPTION, FSDP_PREFIX, MeshPlan, cp_refusal

if TYPE_CHECKING:
    from torch import nn

    from accel_parallel.pipeline import Tie


class ParallelStrategy(ShardedStrategy):
    """Answers for a run on a (dp_replicate, dp_shard, cp, tp) device mesh."""

    def __init__(self, settings: Settings, plan: MeshPlan):
        super().__init__(settings)
        self.plan = plan
        self.pipelines: dict[int, nn.Module] = {}  # id(user's model) -> its PipelineModel (pp > 1)
        self.dropped: dict[int, Any] = {}  # id(original parameter) -> weakref, for parameters of other stages
        self.ties: list[Tie] = []  # tied embeddings held by this process and another pipeline stage's

    # ---- launching ----------------------------------------------------------------------------------------

    @hookimpl
    def accel_launch(self, plan: LaunchPlan) -> int:
        import sys

        from accel_parallel import megatron_notice

        notice = megatron_notice(self.settings)
        if notice:
            print(f"accel: note: {notice}", file=sys.stderr)
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
        self.mesh = init_device_mesh(self.device.type, self.plan.shape, mesh_dim_names=self.plan.dims)
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
        process), with the ``parallelism_config_fsdp_*`` options; with pp > 1 the model is first pruned to this
        process's pipeline stages (``accel_parallel.pipeline``), each stage being its own FSDP root."""
        model.to(self.device)
        if self.plan.pp > 1:
            self.pipeline(kernel, model)
            return
        if self.plan.size("tp") > 1:
            check_heads(model, self.plan.size("tp"))
            plan = tp_plan(model, self.settings["parallelism_config_tp_plan"])
            apply_tensor_parallel(model, self.mesh["tp"], plan, sequence=self.plan.sequence_parallel)
        config = self.shard_config()
        mesh = self.fsdp_mesh()
        if mesh is not None:
            shard_model(model, config, mesh, self.device)
        elif config.activation_checkpointing:  # no FSDP: the layers are checkpointed on their own
            checkpoint_layers(model, config, option=AC_OPTION)

    def shard_config(self, **overrides: Any) -> ShardConfig:
        """FSDP's settings on the data-parallel dims; activation checkpointing when either its own option
        (any mesh) or FSDP's asks for it."""
        config = ShardConfig.from_settings(self.settings, FSDP_PREFIX, **overrides)
        if self.settings[AC_OPTION]:
            config = dataclasses.replace(config, activation_checkpointing=True)
        return config

    def pipeline(self, kernel: KernelView, model: nn.Module) -> None:
        import weakref

        from accel_parallel import pipeline

        plan = None
        if self.plan.size("tp") > 1:
            plan = tp_plan(model, self.settings["parallelism_config_tp_plan"])
        before = dict(model.named_parameters(remove_duplicate=False))

        def parallelize(pruned: nn.Module, stages: list[nn.Module]) -> None:
            if plan is not None:
                apply_tensor_parallel(pruned, self.mesh["tp"], plan, strict=False, sequence=self.plan.sequence_parallel)
                if self.plan.sequence_parallel:  # stages pass their sequence shard of the activations
                    for stage in stages:
                        object.__setattr__(stage, "sequence_mesh", self.mesh["tp"])  # see StageModule
            mesh = self.fsdp_mesh()
            layer_classes = tuple(getattr(pruned, "_no_split_modules", None) or ())
            given = tuple(self.settings[f"{FSDP_PREFIX}transformer_layer_cls_to_wrap"] or ())
            config = self.shard_config(layer_classes=given or layer_classes)
            if mesh is not None:
                for stage in stages:
                    shard_model(stage, config, mesh, self.device)
            elif config.activation_checkpointing:  # no FSDP: this process's layers are checkpointed on their own
                checkpoint_layers(pruned, config, option=AC_OPTION)

        n_stages = self.plan.pp * pipeline.stages_per_rank(self.plan.pp_schedule)
        wrapped = pipeline.build(
            model,
            pp_mesh=self.mesh["pp"],
            schedule=self.plan.pp_schedule,
            microbatches=int(self.settings["parallelism_config_pp_microbatches"]) or n_stages,
            split_points=self.plan.pp_split_points,
            device=self.device,
            scale=kernel.scale_for_accumulation,
            parallelize=parallelize,
            sync=lambda: kernel.sync_gradients,
            pair_group=self.pp_pair_group,
            eval_logits=bool(self.settings["parallelism_config_pp_eval_logits"]),
        )
        self.pipelines[id(model)] = wrapped
        tie = cast("pipeline.Pipeline", wrapped.pipeline).tie
        if tie is not None:
            self.ties.append(tie)
        kept = {id(p) for p in model.parameters()}  # by identity: a tied weight may keep only one of its names
        for param in before.values():
            if id(param) not in kept:
                self.dropped[id(param)] = weakref.ref(param)

    def pp_pair_group(self, a: int, b: int) -> Any:
        """This process's group of the pp ranks ``a`` and ``b`` of its pipeline (None if it is neither);
        **collective** (every process creates every pipeline's pair group)."""
        import torch.distributed as dist

        pairs = [[group[a], group[b]] for group in self.plan.groups("pp")]
        mine, _ = dist.new_subgroups_by_enumeration(pairs)
        return mine

    @hookimpl
    def accel_prepare_training(
        self, kernel: KernelView, models: list[Any], optimizers: list[Any], schedulers: list[Any]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        models, optimizers, schedulers = super().accel_prepare_training(kernel, models, optimizers, schedulers)
        for optimizer in optimizers:  # parameters of other pipeline stages are not this process's to step
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if not self._dropped(p)]
        return [self.pipelines.get(id(m), m) for m in models], optimizers, schedulers

    def flatten_optimizer_state(self) -> bool:
        return self.plan.pp > 1  # each stage saves the parameter groups of its own parameters

    def _dropped(self, param: Any) -> bool:
        ref = self.dropped.get(id(param))
        return ref is not None and ref() is param

    @hookimpl
    def accel_backward(self, kernel: KernelView, loss: Any, backward_kwargs: dict[str, Any]) -> bool | None:
        # the pipeline schedule ran forward and backward when the prepared model was called
        return True if getattr(loss, "accel_pipeline_done", False) else None

    @hookimpl
    def accel_clip_grad_norm(self, kernel: KernelView, parameters: list[Any], max_norm: float, norm_type: float) -> Any:
        if self.plan.pp == 1:
            return clip_grad_norm(parameters, max_norm, norm_type)
        from torch.nn.utils import clip_grads_with_norm_

        # the last stage's copy of a tied embedding is clipped, but its weight counts in the norm once (the
        # first stage's copy, equal to it)
        copies = {id(tie.param) for tie in self.ties if tie.copy}
        norm = clip_grad_norm(
            [p for p in parameters if id(p) not in copies], max_norm, norm_type, group=self.mesh["pp"].get_group()
        )
        copied = [p for p in parameters if id(p) in copies and p.grad is not None]
        if copied:
            clip_grads_with_norm_(copied, max_norm, norm)
        return norm

    @hookimpl
    def accel_optimizer_step(self, kernel: KernelView, optimizer: Any) -> bool | None:
        # megatron_lm_config's gradient_clipping: clip by the global norm before the step (which others apply)
        clip = float(self.settings.get("megatron_lm_gradient_clipping") or 0.0)
        if clip:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self.accel_clip_grad_norm(kernel, params, clip, 2.0)
        return None

    @hookimpl
    def accel_model_state_dict(self, kernel: KernelView, model: Any) -> dict[str, Any] | None:
        """The full state dict on the main process; with pp > 1 each stage's part is gathered over the pipeline."""
        if self.plan.pp == 1:
            return super().accel_model_state_dict(kernel, model)  # type: ignore[no-any-return]
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module = self.model_of(kernel, model)
        if module is None:
            return None
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))  # collective
        state = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        parts: list[Any] = [None] * self.plan.pp
        dist.all_gather_object(parts, state, group=self.mesh["pp"].get_group())
        if not kernel.is_main_process:
            return {}
        return {k: v for part in parts for k, v in part.items()}


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


def _style(name: str, style: str, sequence: bool = False) -> Any:
    """The ``torch.distributed.tensor.parallel`` style named ``style``. With ``sequence`` (Megatron-style sequence
    parallelism) the activations between tensor-parallel regions are sharded along the sequence (``Shard(1)``): a
    colwise layer all-gathers its input from that, a rowwise layer reduce-scatters its output to it (a DTensor, so
    that the residual stream keeps its global shape)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    col: dict[str, Any] = {"input_layouts": Shard(1)} if sequence else {}
    row: dict[str, Any] = {"output_layouts": Shard(1), "use_local_output": False} if sequence else {}
    styles = {
        "colwise": lambda: ColwiseParallel(**col),
        "rowwise": lambda: RowwiseParallel(**row),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate(), **col),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate(), **col),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate(), **row),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), **row),
        "sequence": lambda: SequenceParallel(),
        "sequence_parallel": lambda: SequenceParallel(),
        "sequence_sharded_input": lambda: SequenceParallel(sequence_dim=1, use_local_output=False),
    }
    if style not in styles:
        raise UsageError(
            f"tensor-parallel plan entry {name!r}: unknown style {style!r} (known: {', '.join(sorted(styles))})"
        )
    return styles[style]()


def apply_tensor_parallel(
    model: nn.Module, mesh: Any, plan: Mapping[str, str], strict: bool = True, sequence: bool = False
) -> None:
    """``parallelize_module`` with ``plan``; every pattern must name at least one module (a typo is an error, not a
    layer silently left whole; ``strict=False``: patterns naming modules of other pipeline stages are left out),
    and each sharded dimension must divide by the tp size. ``sequence``: Megatron-style sequence parallelism
    (:func:`sequence_parallel_styles`)."""
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    names = [n for n, _ in model.named_modules() if n]
    resolved: dict[str, Any] = {}
    size = mesh.size()
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not strict:  # a layer of another pipeline stage is a parameter-free placeholder here: left out
            hits = [n for n in hits if any(True for _ in model.get_submodule(n).parameters())]
        if not hits and not strict:
            continue
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
        if strict:
            resolved[pattern] = _style(pattern, str(style), sequence)
        else:  # the modules this stage has, by name (a `*` would also reach the placeholders of other stages)
            resolved.update({hit: _style(pattern, str(style), sequence) for hit in hits})
    if sequence:
        planned = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in plan)]
        resolved.update(sequence_parallel_styles(model, planned))
    parallelize_module(model, mesh, resolved)


def sequence_parallel_styles(model: nn.Module, planned: list[str]) -> dict[str, Any]:
    """The styles Megatron-style sequence parallelism adds to a tensor-parallel plan (whose ``planned`` modules
    then read and write sequence-sharded activations, see :func:`_style`): the norms outside the tensor-parallel
    regions run on their sequence shard (``SequenceParallel``; dropout on the residual stream then is sharded too,
    the stream being a ``Shard(1)`` DTensor), and the input embedding's output is split along the sequence
    (``PrepareModuleOutput``) unless the plan shards the embedding itself. Needs a model with a sequence dimension:
    a Hugging Face decoder (``get_input_embeddings``) whose LM head is in the plan."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel

    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        raise UsageError(
            f"parallelism_config_tp_sequence_parallel: {type(model).__name__} is not a Hugging Face decoder "
            "(no get_input_embeddings/get_output_embeddings), so accel cannot tell its sequence dimension; "
            "turn sequence parallelism off for it"
        )
    by_module = {id(m): n for n, m in model.named_modules()}
    head = by_module.get(id(get_out()))
    if head is not None and head not in planned:  # a pruned pipeline stage has no head (None)
        raise UsageError(
            f"parallelism_config_tp_sequence_parallel: the tensor-parallel plan of {type(model).__name__} does "
            f'not include its LM head {head!r}; add it (e.g. "{head}": "colwise_rep") or turn sequence '
            "parallelism off"
        )
    embed = by_module.get(id(get_in()))
    # the blocks that hold the tensor-parallel layers (attention, MLP), not the embedding's or the head's parent
    regions = {n.rsplit(".", 1)[0] for n in planned if "." in n and n not in (embed, head)}
    styles: dict[str, Any] = {}
    for name, module in model.named_modules():
        norm = isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or type(module).__name__.endswith("Norm")
        inside = any(name.startswith(r + ".") for r in regions)  # e.g. Qwen3's q_norm: on local heads
        if norm and name not in planned and not inside:
            styles[name] = SequenceParallel()
    if embed is not None and embed not in planned:
        styles[embed] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        )
    return styles
