"""Turning a user's model into an FSDP2 model, and the optimizer over it.

``shard_model`` picks the shard units (auto-wrap policy), optionally adds activation checkpointing to them, calls
``fully_shard`` bottom-up and finally on the root. ``fully_shard`` replaces every parameter by a new DTensor
parameter, so an optimizer built before ``prepare`` points at tensors the model no longer uses: ``ParamSwap``
remembers old -> new and rewrites the optimizer's parameter groups.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from accel import UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class ShardConfig:
    """What ``shard_model`` needs from the settings."""

    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    layer_classes: tuple[str, ...] = ()
    min_num_params: int = 100_000_000
    reshard_after_forward: bool = True
    offload_params: bool = False
    activation_checkpointing: bool = False
    param_dtype: torch.dtype | None = None  # bf16 mixed precision: FSDP casts parameters for compute


def wrap_units(model: nn.Module, config: ShardConfig) -> list[nn.Module]:
    """The submodules (never the root) that become shard units of their own, in post-order (bottom-up)."""
    policy = config.auto_wrap_policy
    if policy == "NO_WRAP":
        return []
    if policy == "TRANSFORMER_BASED_WRAP":
        names = set(config.layer_classes)
        explicit = bool(names)
        if not names:
            names = set(getattr(model, "_no_split_modules", None) or ())
        present = {type(m).__name__ for m in model.modules()}
        missing = sorted(names - present)
        if explicit and missing:
            raise UsageError(
                f"fsdp_transformer_layer_cls_to_wrap: no module of class {', '.join(missing)} in "
                f"{type(model).__name__} (classes there: {', '.join(sorted(present))})"
            )
        return [m for m in _post_order(model) if m is not model and type(m).__name__ in names]
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        """Parameters under ``module`` not yet claimed by a unit below it."""
        count = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            count += visit(child)
        if module is not model and count >= config.min_num_params:
            units.append(module)
            return 0
        return count

    visit(model)
    return units


def _post_order(module: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out


def shard_model(
    model: nn.Module,
    config: ShardConfig,
    mesh: Any,
    device: torch.device,
    broadcast_from_main: bool,
    rank: int,
    broadcast: Callable[[torch.Tensor], None],
) -> nn.Module:
    """Shard ``model`` in place (its class becomes an ``FSDPModule``) and return it.

    ``broadcast_from_main`` (``fsdp_cpu_ram_efficient_loading``): only the main process needs real weights; the
    model is moved to the meta device everywhere, sharded, allocated, then filled from the main process's copy."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    full: dict[str, Any] = {}  # tensors (set_model_state_dict's dict[str, ValueType])
    extra: dict[str, torch.Tensor] = {}  # non-persistent buffers: not in the state dict, lost by to_empty
    if broadcast_from_main:
        if rank == 0:
            if on_meta:
                raise UsageError(
                    "fsdp_cpu_ram_efficient_loading: the main process must build the model with real "
                    "weights (only the other processes may use the meta device)"
                )
            full = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        persistent = set(model.state_dict().keys())
        extra = {n: b.detach().cpu() if rank == 0 else b for n, b in model.named_buffers() if n not in persistent}
        model.to("meta")
    elif on_meta:
        raise UsageError(
            "the model has parameters on the meta device; build it with real weights, or set "
            "fsdp_cpu_ram_efficient_loading so the main process's weights are broadcast"
        )

    units = wrap_units(model, config)
    if config.activation_checkpointing:
        if not units:
            raise UsageError(
                "fsdp_activation_checkpointing needs layers to checkpoint: set "
                "fsdp_transformer_layer_cls_to_wrap (or fsdp_auto_wrap_policy SIZE_BASED_WRAP)"
            )
        from torch.distributed._composable import checkpoint

        for unit in units:
            checkpoint(unit)
    mp = (
        MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=torch.float32)
        if config.param_dtype is not None
        else MixedPrecisionPolicy()
    )
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda") if config.offload_params else OffloadPolicy()
    )
    kwargs = dict(mesh=mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=mp, offload_policy=offload)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)

    if broadcast_from_main:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device=torch.device("cpu") if config.offload_params else device)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        buffers = dict(model.named_buffers())
        for name in sorted(extra):
            value = extra[name].to(buffers[name].device) if rank == 0 else torch.empty_like(buffers[name])
            broadcast(value)
            with torch.no_grad():
                buffers[name].copy_(value)
    return model


class ParamSwap:
    """Remembers which sharded parameter replaced which original one, so optimizers built on the originals can be
    pointed at the shards (also for an optimizer prepared in a later ``prepare`` call)."""

    def __init__(self) -> None:
        self._map: dict[int, tuple[weakref.ref[Any], Any]] = {}
        self.owner: dict[int, Any] = {}  # id(new parameter) -> the model it belongs to

    def record(self, model: nn.Module) -> dict[str, Any]:
        """Before sharding: name -> original parameter (every name, tied ones included)."""
        return dict(model.named_parameters(remove_duplicate=False))

    def update(self, model: nn.Module, before: dict[str, Any]) -> None:
        """After sharding: map each original parameter to the new one of the same name."""
        after = dict(model.named_parameters(remove_duplicate=False))
        for name, old in before.items():
            new = after.get(name)
            if new is None or new is old:
                continue
            self._map[id(old)] = (weakref.ref(old), new)
            self.owner[id(new)] = model

    def new_param(self, param: Any) -> Any:
        entry = self._map.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return param

    def swap(self, optimizer: torch.optim.Optimizer) -> list[Any]:
        """Point ``optimizer`` at the sharded parameters, in place. Returns the models its parameters belong to."""
        groups = optimizer.param_groups
        if any(optimizer.state.get(p) for g in groups for p in g["params"]):
            raise UsageError(
                "the optimizer already has state (it took a step before prepare); with --plugin fsdp, "
                "prepare the model and optimizer before training, then load state with load_state"
            )
        models: list[Any] = []
        for group in groups:
            group["params"] = [self.new_param(p) for p in group["params"]]
            for p in group["params"]:
                model = self.owner.get(id(p))
                if model is not None and all(m is not model for m in models):
                    models.append(model)
        return models
