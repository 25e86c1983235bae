"""The N-D parallel strategy component: process group, device mesh, tensor parallel (``parallelize_module``), FSDP2 on
the data-parallel dims (``fully_shard``, HSDP when dp_replicate > 1), the optimizer swap, sharded gradient clipping,
the data-parallel topology, full state dicts and torch.distributed.checkpoint items. torch is imported inside
methods."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel import ItemRecord, LaunchPlan, Settings, Topology, UsageError, hookimpl
from accel.distributed import (
    ProcessGroupComponent,
    launch_with_torchrun,
    local_device,
    restart_store_args,
    torchrun_env,
)
from accel_parallel import DIMS, MeshPlan, cp_refusal

if TYPE_CHECKING:
    import torch
    from torch import nn

    from accel.kernel import Kernel

TIMEOUT_S = 1800.0
DCP_FORMAT = "torch.distributed.checkpoint"


class ParallelStrategy(ProcessGroupComponent):
    """Answers for a run on a (dp_replicate, dp_shard, cp, tp) device mesh."""

    role = "strategy"
    provides = frozenset({"distributed", "sharding", "precision:bf16"})  # bf16: realised here, not by amp

    def __init__(self, settings: Settings, plan: MeshPlan):
        self.settings = settings
        self.plan = plan
        self.owns_process_group = False
        self.swap = ParamSwap()
        self.models: list[Any] = []  # the models this strategy prepared
        self.optimizer_models: dict[int, list[Any]] = {}  # id(optimizer) -> the prepared models it steps

    # ---- launching ----------------------------------------------------------------------------------------

    @hookimpl
    def accel_launch(self, plan: LaunchPlan) -> int:
        if plan.dry_run:
            print("\n".join(self.plan.describe()))
        return launch_with_torchrun(plan, "parallel")

    # ---- process start-up ---------------------------------------------------------------------------------

    @hookimpl
    def accel_setup(self, kernel: Kernel) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        torchrun_env(os.environ)
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.device = local_device(self.local_rank, self.settings["cpu"])
        if self.plan.size("cp") > 1 and self.device.type != "cuda":
            raise UsageError(cp_refusal(self.settings, cuda=False) or "context parallel needs CUDA")
        if not dist.is_initialized():
            backend = dist.get_default_backend_for_device(self.device)
            timeout = timedelta(seconds=TIMEOUT_S)
            dist.init_process_group(
                backend=backend,
                timeout=timeout,
                device_id=self.device if self.device.type != "cpu" else None,
                **restart_store_args(os.environ, timeout, "accel-parallel"),
            )
            self.owns_process_group = True
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
    def accel_topology(self, kernel: Kernel) -> Topology:
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

    @hookimpl
    def accel_autocast(self, kernel: Kernel) -> Any:
        # bf16 is realised by FSDP's MixedPrecisionPolicy: no autocast, and no precision plugin.
        return contextlib.nullcontext if self.settings.mixed_precision == "bf16" else None

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

    @hookimpl
    def accel_prepare_training(
        self, kernel: Kernel, models: list[Any], optimizers: list[Any], schedulers: list[Any]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        for model in models:
            if any(model is m for m in self.models):
                continue  # prepared before
            before = self.swap.record(model)
            model.to(self.device)
            if self.plan.size("tp") > 1:
                apply_tensor_parallel(
                    model, self.mesh["tp"], tp_plan(model, self.settings["parallelism_config_tp_plan"])
                )
            mesh = self.fsdp_mesh()
            if mesh is not None:
                shard(model, mesh, self.settings.mixed_precision == "bf16")
            self.swap.update(model, before)
            self.models.append(model)
        for optimizer in optimizers:
            self.optimizer_models[id(optimizer)] = self.swap.swap(optimizer)
        return list(models), list(optimizers), list(schedulers)

    # ---- training step ------------------------------------------------------------------------------------

    @hookimpl
    def accel_no_sync(self, kernel: Kernel, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any] | None:
        from torch.distributed.fsdp import FSDPModule

        module = kernel.unwrap_model(model)
        if isinstance(module, FSDPModule):
            return _skip_gradient_sync(module)
        return contextlib.nullcontext() if any(module is m for m in self.models) else None

    @hookimpl
    def accel_clip_grad_norm(
        self, kernel: Kernel, parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        return clip_grad_norm(parameters, max_norm, norm_type)

    # ---- state --------------------------------------------------------------------------------------------

    def _mine(self, kernel: Kernel, obj: Any) -> Any | None:
        from torch import nn

        if not isinstance(obj, nn.Module):
            return None
        module = kernel.unwrap_model(obj)
        return module if any(module is m for m in self.models) else None

    @hookimpl
    def accel_model_state_dict(self, kernel: Kernel, model: torch.nn.Module) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module = self._mine(kernel, model)
        if module is None:
            return None
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if kernel.is_main_process else {}

    def _optimizer_model(self, key: str, obj: Any) -> tuple[Any, Any] | None:
        import torch

        if not isinstance(obj, torch.optim.Optimizer):
            return None
        inner = getattr(obj, "optimizer", obj)  # the kernel's PreparedOptimizer wraps the user's
        models = self.optimizer_models.get(id(inner))
        if not models:
            return None
        if len(models) > 1:
            raise UsageError(
                f"checkpoint item {key!r}: the optimizer steps parameters of {len(models)} models; "
                "with --plugin parallel use one optimizer per model"
            )
        return inner, models[0]

    @hookimpl
    def accel_save_state(
        self, kernel: Kernel, items: Mapping[str, Any], directory: Path, asynchronous: bool
    ) -> dict[str, ItemRecord]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        mine = {
            k: v
            for k, v in items.items()
            if self._mine(kernel, v) is not None or self._optimizer_model(k, v) is not None
        }
        if not mine:
            return {}
        if asynchronous:
            raise UsageError(
                "save_state(asynchronous=True) is not supported with --plugin parallel: its checkpoints "
                "are written by torch.distributed.checkpoint, whose collectives must run on the training "
                "thread; call save_state() without asynchronous=True"
            )
        if not kernel.sync_gradients:
            raise UsageError(
                "save_state in the middle of gradient accumulation is not supported with --plugin "
                "parallel; save on a step that synchronises (if kernel.sync_gradients: ...)"
            )
        records: dict[str, ItemRecord] = {}
        for key in sorted(mine):  # the same order on every rank: each save is a collective
            obj = mine[key]
            model = self._mine(kernel, obj)
            state: dict[str, Any]
            if model is not None:
                state = get_model_state_dict(model)
            else:
                optimizer, model = self._optimizer_model(key, obj)  # type: ignore[misc]
                state = get_optimizer_state_dict(model, optimizer)
            _dcp_save(state, Path(directory) / key)
            records[key] = ItemRecord(plugin=self.name, format=DCP_FORMAT, files=(key,))
        return records

    @hookimpl
    def accel_load_state(
        self, kernel: Kernel, items: Mapping[str, Any], directory: Path, records: Mapping[str, ItemRecord]
    ) -> Iterable[str]:
        mine = sorted(k for k, rec in records.items() if rec.plugin == self.name)
        missing = [k for k in mine if k not in items]
        if missing:
            raise UsageError(
                f"the checkpoint holds {missing} (written by accel-plugin-parallel) but this run did not prepare them"
            )
        self.load_items(kernel, Path(directory), {k: items[k] for k in mine})
        return mine

    def load_items(self, kernel: Kernel, directory: Path, objects: Mapping[str, Any]) -> None:
        """Restore models and optimizers from DCP directories by item key, resharding onto this run's mesh."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from accel.checkpoint import dcp_load

        for key in sorted(objects):  # the same order on every rank: each load is a collective
            path = directory / key
            if not (path / ".metadata").is_file():
                raise UsageError(f"{directory} has no item {key!r} written by torch.distributed.checkpoint")
            obj = objects[key]
            model = self._mine(kernel, obj)
            if model is not None:
                state = get_model_state_dict(model)
                dcp_load(state, path)
                set_model_state_dict(model, state)
                continue
            pair = self._optimizer_model(key, obj)
            if pair is None:
                raise UsageError(
                    f"checkpoint item {key!r} was written by accel-plugin-parallel, but in this run "
                    f"{key!r} is not a model or optimizer prepared with --plugin parallel"
                )
            optimizer, model = pair
            optim_state: dict[str, Any] = get_optimizer_state_dict(model, optimizer)
            dcp_load(optim_state, path)
            set_optimizer_state_dict(model, optimizer, optim_state)


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from accel import CheckpointError
    from accel.checkpoint import error_line

    try:
        dcp.save(state, checkpoint_id=path)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise CheckpointError(f"cannot write {path}: {error_line(exc)}") from None


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


# ---- FSDP2 on the data-parallel dims (the small part of accel-plugin-fsdp this plugin needs, copied) --------


def shard(model: nn.Module, mesh: Any, bf16: bool) -> None:
    """``fully_shard`` each layer named by the model's ``_no_split_modules`` (Hugging Face), then the root."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in [m for m in model.modules() if m is not model and type(m).__name__ in layers][::-1]:
        fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


class ParamSwap:
    """Remembers which sharded parameter replaced which original one, so optimizers built on the originals can be
    pointed at the new ones (``parallelize_module`` and ``fully_shard`` both replace every parameter)."""

    def __init__(self) -> None:
        self._map: dict[int, tuple[weakref.ref[Any], Any]] = {}
        self.owner: dict[int, Any] = {}  # id(new parameter) -> the model it belongs to

    def record(self, model: nn.Module) -> dict[str, Any]:
        return dict(model.named_parameters(remove_duplicate=False))

    def update(self, model: nn.Module, before: dict[str, Any]) -> None:
        after = dict(model.named_parameters(remove_duplicate=False))
        for name, old in before.items():
            new = after.get(name)
            if new is not None:
                self.owner[id(new)] = model
            if new is None or new is old:
                continue
            self._map[id(old)] = (weakref.ref(old), new)

    def new_param(self, param: Any) -> Any:
        entry = self._map.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return param

    def swap(self, optimizer: torch.optim.Optimizer) -> list[Any]:
        groups = optimizer.param_groups
        if any(optimizer.state.get(p) for g in groups for p in g["params"]):
            raise UsageError(
                "the optimizer already has state (it took a step before prepare); with --plugin "
                "parallel, prepare the model and optimizer before training, then load state with "
                "load_state"
            )
        models: list[Any] = []
        for group in groups:
            group["params"] = [self.new_param(p) for p in group["params"]]
            for p in group["params"]:
                model = self.owner.get(id(p))
                if model is not None and all(m is not model for m in models):
                    models.append(model)
        return models


@contextlib.contextmanager
def _skip_gradient_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip by the global norm and return it (before clipping). Gradients live on different meshes (tp-sharded
    layers on the whole mesh, the rest on the data-parallel dims), so each gradient's norm is made whole with
    ``full_tensor()`` (a collective over its own mesh) before they are combined."""
    import torch
    from torch.distributed.tensor import DTensor

    norms = []
    for p in parameters:
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad, norm_type)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().cpu())
    if not norms:
        return torch.tensor(0.0)
    parts = torch.stack(norms)
    total = parts.max() if norm_type == float("inf") else parts.pow(norm_type).sum().pow(1.0 / norm_type)
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))  # clip_grads_with_norm_'s factor
    if coef < 1.0:  # one gradient at a time: a foreach over gradients on different meshes is refused by DTensor
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(coef)
    device = next(p.grad for p in parameters if p.grad is not None).device
    return total.to(device)
