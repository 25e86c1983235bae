"""The FSDP2 strategy component: process group, device mesh, ``fully_shard``, optimizer swap, sharded gradient
clipping, no_sync, full state dicts and sharded checkpoints. torch is imported inside methods."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel import ItemRecord, LaunchPlan, Settings, UsageError, hookimpl
from accel.distributed import ProcessGroupComponent, local_device, restart_store_args
from accel_fsdp import checkpoint, process, reshard_after_forward
from accel_fsdp.sharding import ParamSwap, ShardConfig, shard_model

if TYPE_CHECKING:
    import torch

    from accel.kernel import Kernel

TIMEOUT_S = 1800.0


class FSDPStrategy(ProcessGroupComponent):
    """Answers for a fully sharded run (FSDP2). Activated only when selected (``--plugin fsdp``)."""

    role = "strategy"
    provides = frozenset({"distributed", "sharding", "precision:bf16"})  # bf16: realised here, not by amp

    def __init__(self, settings: Settings):
        self.settings = settings
        self.owns_process_group = False
        self.swap = ParamSwap()
        self.optimizer_models: dict[int, list[Any]] = {}  # id(optimizer) -> the sharded models it steps

    # ---- launching ----------------------------------------------------------------------------------------

    @hookimpl
    def accel_launch(self, plan: LaunchPlan) -> int:
        return process.launch(plan)

    # ---- process start-up ---------------------------------------------------------------------------------

    @hookimpl
    def accel_setup(self, kernel: Kernel) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        process.distributed_env()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.device = local_device(self.local_rank, self.settings["cpu"])
        if not dist.is_initialized():
            backend = dist.get_default_backend_for_device(self.device)
            timeout = timedelta(seconds=TIMEOUT_S)
            dist.init_process_group(
                backend=backend,
                timeout=timeout,
                device_id=self.device if self.device.type != "cpu" else None,
                **restart_store_args(os.environ, timeout, "accel-fsdp"),
            )
            self.owns_process_group = True
        self.mesh = init_device_mesh(self.device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))

    # ---- precision ----------------------------------------------------------------------------------------

    @hookimpl
    def accel_autocast(self, kernel: Kernel) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
        # bf16 (declared in provides, so the kernel left the precision plugin out) is realised by
        # MixedPrecisionPolicy inside fully_shard: no autocast, but prepared models still return fp32 outputs.
        return contextlib.nullcontext if self.settings.mixed_precision == "bf16" else None

    # ---- prepare ------------------------------------------------------------------------------------------

    def shard_config(self) -> ShardConfig:
        import torch

        s = self.settings
        return ShardConfig(
            auto_wrap_policy=s["fsdp_auto_wrap_policy"],
            layer_classes=tuple(s["fsdp_transformer_layer_cls_to_wrap"] or ()),
            min_num_params=int(s["fsdp_min_num_params"]),
            reshard_after_forward=reshard_after_forward(s),
            offload_params=bool(s["fsdp_offload_params"]),
            activation_checkpointing=bool(s["fsdp_activation_checkpointing"]),
            param_dtype=torch.bfloat16 if s.mixed_precision == "bf16" else None,
        )

    @hookimpl
    def accel_prepare_training(
        self, kernel: Kernel, models: list[Any], optimizers: list[Any], schedulers: list[Any]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        from torch.distributed.fsdp import FSDPModule

        config = self.shard_config()
        efficient = bool(self.settings["fsdp_cpu_ram_efficient_loading"]) and kernel.num_processes > 1

        def broadcast(tensor: torch.Tensor) -> None:
            kernel.collectives.broadcast(tensor, 0)

        for model in models:
            if isinstance(model, FSDPModule):
                continue  # prepared before
            before = self.swap.record(model)
            shard_model(model, config, self.mesh, self.device, efficient, kernel.process_index, broadcast)
            self.swap.update(model, before)
        for optimizer in optimizers:
            self.optimizer_models[id(optimizer)] = self.swap.swap(optimizer)
        return list(models), list(optimizers), list(schedulers)

    # ---- training step ------------------------------------------------------------------------------------

    @hookimpl
    def accel_no_sync(self, kernel: Kernel, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any] | None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            return None
        return _skip_gradient_sync(model)

    @hookimpl
    def accel_clip_grad_norm(
        self, kernel: Kernel, parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        return clip_grad_norm(parameters, max_norm, norm_type)

    # ---- state --------------------------------------------------------------------------------------------

    @hookimpl
    def accel_model_state_dict(self, kernel: Kernel, model: torch.nn.Module) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        module = kernel.unwrap_model(model)
        if not isinstance(module, FSDPModule):
            return None
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _sharded_model(self, kernel: Kernel, obj: Any) -> Any | None:
        from torch import nn
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(obj, nn.Module):
            return None
        module = kernel.unwrap_model(obj)
        return module if isinstance(module, FSDPModule) else None

    def _optimizer_model(self, key: str, obj: Any) -> tuple[Any, Any] | None:
        """(the user's optimizer, the one sharded model it steps) for a prepared optimizer of a sharded model."""
        import torch

        if not isinstance(obj, torch.optim.Optimizer):  # a prepared scheduler has an .optimizer too
            return None
        inner = getattr(obj, "optimizer", obj)  # the kernel's PreparedOptimizer wraps the user's
        models = self.optimizer_models.get(id(inner))
        if not models:
            return None
        if len(models) > 1:
            raise UsageError(
                f"checkpoint item {key!r}: the optimizer steps parameters of {len(models)} sharded "
                "models; with --plugin fsdp use one optimizer per model"
            )
        return inner, models[0]

    @hookimpl
    def accel_save_state(
        self, kernel: Kernel, items: Mapping[str, Any], directory: Path, asynchronous: bool
    ) -> dict[str, ItemRecord]:
        if asynchronous and any(self._sharded_model(kernel, obj) is not None for obj in items.values()):
            raise UsageError(
                "save_state(asynchronous=True) is not supported with --plugin fsdp: its checkpoints are "
                "written by torch.distributed.checkpoint, whose collectives must run on the training "
                "thread; call save_state() without asynchronous=True (and async_save: false)"
            )
        if not kernel.sync_gradients and self.optimizer_models:
            raise UsageError(
                "save_state in the middle of gradient accumulation is not supported with --plugin fsdp "
                "(FSDP keeps the partial gradients unsharded, outside the parameters); save on a step "
                "that synchronises (if kernel.sync_gradients: ...)"
            )
        full = self.settings["fsdp_state_dict_type"] == "FULL_STATE_DICT"
        records: dict[str, ItemRecord] = {}
        for key in sorted(items):  # the same order on every rank: each save is a collective
            obj = items[key]
            model = self._sharded_model(kernel, obj)
            if model is not None:
                records[key] = checkpoint.save_model(kernel, model, key, Path(directory), full)
                continue
            pair = self._optimizer_model(key, obj)
            if pair is not None:
                records[key] = checkpoint.save_optimizer(kernel, pair[1], pair[0], key, Path(directory), full)
        return records

    @hookimpl
    def accel_load_state(
        self, kernel: Kernel, items: Mapping[str, Any], directory: Path, records: Mapping[str, ItemRecord]
    ) -> Iterable[str]:
        mine = {k: rec for k, rec in records.items() if rec.plugin == self.name}
        missing = sorted(k for k in mine if k not in items)
        if missing:
            raise UsageError(
                f"the checkpoint holds {missing} (written by accel-plugin-fsdp) but this run did not prepare them"
            )
        self.load_items(kernel, Path(directory), {k: items[k] for k in mine}, mine)
        return sorted(mine)

    def load_items(
        self,
        kernel: Kernel,
        directory: Path,
        objects: Mapping[str, Any],
        records: Mapping[str, ItemRecord] | None = None,
    ) -> None:
        """Restore sharded models and optimizers by item key; records default to what the files show."""
        for key in sorted(objects):  # the same order on every rank: each load is a collective
            record = records[key] if records is not None else checkpoint.detect_record(directory, key)
            if record is None:
                raise UsageError(f"{directory} has no item {key!r} written by accel-plugin-fsdp")
            obj = objects[key]
            model = self._sharded_model(kernel, obj)
            pair = None if model is not None else self._optimizer_model(key, obj)
            if model is not None:
                checkpoint.load_model(kernel, model, key, directory, record)
            elif pair is not None:
                checkpoint.load_optimizer(kernel, pair[1], pair[0], key, directory, record)
            else:
                raise UsageError(
                    f"checkpoint item {key!r} was written by accel-plugin-fsdp, but in this run "
                    f"{key!r} is not a model or optimizer prepared with --plugin fsdp"
                )


@contextlib.contextmanager
def _skip_gradient_sync(model: Any) -> Iterator[None]:
    """Accumulate unsharded gradients locally: no reduce-scatter in the backward passes inside."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip by the global norm over all ranks and return that norm (before clipping).

    Sharded gradients (DTensors) give a partial norm that ``full_tensor()`` reduces over the mesh; plain gradients
    (parameters outside any FSDP module, replicated) count once."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    norms = []
    if sharded:
        norm = get_total_norm(sharded, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if plain:
        norms.append(get_total_norm(plain, norm_type))
    if not norms:
        return torch.tensor(0.0)
    if len(norms) == 1:
        total = norms[0]
    else:
        device = norms[0].device
        parts = torch.stack([n.to(device, torch.float32) for n in norms])
        total = parts.max() if norm_type == float("inf") else parts.pow(norm_type).sum().pow(1.0 / norm_type)
    clip_grads_with_norm_(parameters, max_norm, total)
    return total
