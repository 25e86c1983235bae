"""The sharded-training toolkit of the plugin API: what a strategy that shards a model with FSDP2 (torch
``fully_shard``) on a device mesh needs, written once. accel-plugin-fsdp (a 1-D mesh) and accel-plugin-parallel (an
N-D mesh) are both built on it.

- :func:`declare_shard_options`, :class:`ShardConfig`, :func:`wrap_units` and :func:`shard_model`: ``fully_shard``
  with a wrap policy (layer classes or a parameter count), CPU offload, activation checkpointing, bf16 through
  FSDP's ``MixedPrecisionPolicy`` and loading from the main process's weights only.
- :class:`ParamSwap`: points an optimizer built on the original parameters at the sharded ones, and maps each
  optimizer to the models it steps.
- :func:`clip_grad_norm`: gradient clipping by the global norm over sharded (DTensor) and plain gradients.
- :func:`dcp_save`, :func:`save_model`, :func:`load_model`, :func:`save_optimizer`, :func:`load_optimizer`,
  :func:`detect_record`: checkpoint items as torch.distributed.checkpoint (DCP) directories or full state dicts.
- :class:`ShardedStrategy`: the strategy component made of the above (process group, prepare, no_sync, clipping,
  state dicts, ``save_state``/``load_state``); a plugin subclasses it and says how one model is sharded.
- :func:`load_sharded`: load a model and optimizer from such a checkpoint onto any number of processes.

Import it explicitly (``from accel.spi import sharded``). Importing it does not import torch: every function imports
what it needs. Each docstring says whether the function is **collective** (call it on every process of the mesh, in
the same order) or local.

Why one module of this size: it is one toolkit that two plugins import as a unit (``from accel.spi import
sharded``), its strategy class calls every helper in it, and a plugin author finds what FSDP2 needs in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from accel.contract import DCP_FORMAT, ItemRecord
from accel.distributed import ProcessGroupComponent, local_device, restart_store_args, torchrun_env
from accel.errors import CheckpointError, UsageError
from accel.hookspecs import hookimpl
from accel.options import Settings

if TYPE_CHECKING:
    import torch
    from torch import nn

    from accel.contract import KernelView

__all__ = [
    "DCP_FORMAT",
    "FRESH",
    "FULL_MODEL_FORMAT",
    "FULL_OPTIM_FORMAT",
    "WRAP_POLICIES",
    "ParamSwap",
    "ShardConfig",
    "ShardedStrategy",
    "checkpoint_layers",
    "clip_grad_norm",
    "dcp_save",
    "declare_shard_options",
    "detect_record",
    "load_model",
    "load_optimizer",
    "load_sharded",
    "save_model",
    "save_optimizer",
    "shard_model",
    "wrap_units",
]

#: The ``auto_wrap_policy`` values (Accelerate's names).
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
#: Formats of checkpoint items (``ItemRecord.format``; ``DCP_FORMAT`` is :data:`accel.contract.DCP_FORMAT`).
FULL_MODEL_FORMAT = "safetensors-full"
FULL_OPTIM_FORMAT = "torch-weights-only-full"
#: Saved next to an optimizer's state: whether it had taken no step yet (loading then empties the state again).
FRESH = "accel_fsdp_fresh"
#: Saved next to an optimizer's DCP state written with ``flatten`` (parameter groups per parameter name).
_FLAT = "accel_optimizer_flat"
#: How long a collective may wait before the process group gives up.
TIMEOUT_S = 1800.0


# ---- options and fully_shard ------------------------------------------------------------------------------------


def declare_shard_options(add: Callable[..., None], prefix: str) -> None:
    """Declare the options of :class:`ShardConfig` as ``<prefix><name>`` through ``add(name, **options.add kwargs)``
    (the plugin's own wrapper of ``options.add``, which sets its config key): ``auto_wrap_policy``,
    ``transformer_layer_cls_to_wrap``, ``min_num_params``, ``reshard_after_forward``, ``offload_params`` and
    ``activation_checkpointing``, with Accelerate's ``fsdp_*`` meanings. Local."""
    add(
        f"{prefix}auto_wrap_policy",
        default="TRANSFORMER_BASED_WRAP",
        choices=WRAP_POLICIES,
        help=f"Which submodules become their own shard unit: by layer class ({prefix}transformer_layer_cls_to_wrap, "
        f"else the model's _no_split_modules), by parameter count ({prefix}min_num_params), or only the root.",
    )
    add(
        f"{prefix}transformer_layer_cls_to_wrap",
        type="list",
        default=[],
        help="Comma-separated class names of the layers to shard one by one (TRANSFORMER_BASED_WRAP).",
    )
    add(
        f"{prefix}min_num_params",
        type="int",
        default=100_000_000,
        minimum=1,
        help="Parameters a submodule needs to become its own shard unit (SIZE_BASED_WRAP).",
    )
    add(
        f"{prefix}reshard_after_forward",
        type="bool",
        default=True,
        help="Free the gathered parameters after forward (less memory, one more all-gather in backward).",
    )
    add(
        f"{prefix}offload_params",
        type="bool",
        default=False,
        help="Keep sharded parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy).",
    )
    add(
        f"{prefix}activation_checkpointing",
        type="bool",
        default=False,
        help="Recompute the activations of each wrapped layer in backward instead of keeping them.",
    )


@dataclasses.dataclass(frozen=True)
class ShardConfig:
    """What :func:`shard_model` does. ``prefix`` is the plugin's option prefix, for messages naming options;
    ``loading_option`` the option that lets processes other than the main one build the model on the meta device
    (``""``: the plugin has none)."""

    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    layer_classes: tuple[str, ...] = ()
    min_num_params: int = 100_000_000
    reshard_after_forward: bool = True
    offload_params: bool = False
    activation_checkpointing: bool = False
    param_dtype: torch.dtype | None = None  # bf16 mixed precision: FSDP casts parameters for compute
    prefix: str = "fsdp_"
    loading_option: str = ""

    @classmethod
    def from_settings(cls, settings: Settings, prefix: str, **overrides: Any) -> ShardConfig:
        """The options :func:`declare_shard_options` declared under ``prefix``; bf16 when ``mixed_precision`` is
        bf16. Local."""
        import torch

        values: dict[str, Any] = dict(
            auto_wrap_policy=settings[f"{prefix}auto_wrap_policy"],
            layer_classes=tuple(settings[f"{prefix}transformer_layer_cls_to_wrap"] or ()),
            min_num_params=int(settings[f"{prefix}min_num_params"]),
            reshard_after_forward=bool(settings[f"{prefix}reshard_after_forward"]),
            offload_params=bool(settings[f"{prefix}offload_params"]),
            activation_checkpointing=bool(settings[f"{prefix}activation_checkpointing"]),
            param_dtype=torch.bfloat16 if settings.mixed_precision == "bf16" else None,
            prefix=prefix,
        )
        return cls(**{**values, **overrides})


def wrap_units(model: nn.Module, config: ShardConfig) -> list[nn.Module]:
    """The submodules (never the root) that become shard units of their own, in post-order (bottom-up). Local."""
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
                f"{config.prefix}transformer_layer_cls_to_wrap: no module of class {', '.join(missing)} in "
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
    main_weights_only: KernelView | None = None,
) -> nn.Module:
    """``fully_shard`` each unit of :func:`wrap_units` (with activation checkpointing when configured), then the
    root, on ``mesh`` (1-D: FSDP; 2-D: HSDP, replicas x shards), in place, and return the model. **Collective**
    over ``mesh``.

    ``main_weights_only`` (a kernel of more than one process): only the main process needs real weights; the model
    is moved to the meta device everywhere, sharded, allocated, then filled from the main process's copy."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    full: dict[str, Any] = {}  # tensors (set_model_state_dict's dict[str, ValueType])
    extra: dict[str, torch.Tensor] = {}  # non-persistent buffers: not in the state dict, lost by to_empty
    main = main_weights_only is None or main_weights_only.is_main_process
    if main_weights_only is not None:
        if main:
            if on_meta:
                raise UsageError(
                    f"{config.loading_option}: the main process must build the model with real "
                    "weights (only the other processes may use the meta device)"
                )
            full = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        persistent = set(model.state_dict().keys())
        extra = {n: b.detach().cpu() if main else b for n, b in model.named_buffers() if n not in persistent}
        model.to("meta")
    elif on_meta:
        hint = f", or set {config.loading_option} so the main process's weights are broadcast"
        raise UsageError(
            "the model has parameters on the meta device; build it with real weights"
            + (hint if config.loading_option else "")
        )

    units = wrap_units(model, config)
    if config.activation_checkpointing:
        checkpoint_layers(model, config, units)
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
    _average_gradients(model, mesh)

    if main_weights_only is not None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        model.to_empty(device=torch.device("cpu") if config.offload_params else device)
        set_model_state_dict(model, full, options=_state_options(full=True, broadcast=True))
        buffers = dict(model.named_buffers())
        for name in sorted(extra):
            value = extra[name].to(buffers[name].device) if main else torch.empty_like(buffers[name])
            main_weights_only.collectives.broadcast(value, 0)
            with torch.no_grad():
                buffers[name].copy_(value)
    return model


def checkpoint_layers(
    model: nn.Module, config: ShardConfig, units: list[nn.Module] | None = None, option: str = ""
) -> list[nn.Module]:
    """Activation checkpointing, on its own (no sharding needed): each of ``units`` (default: the layers
    :func:`wrap_units` picks) recomputes its activations in backward (torch's composable ``checkpoint``,
    non-reentrant), in place; returns them. ``option`` names the setting that asked for it in the one line that
    refuses a model with no such layer (default: ``<prefix>activation_checkpointing``). Local."""
    from torch.distributed._composable import checkpoint

    units = wrap_units(model, config) if units is None else units
    if not units:
        raise UsageError(
            f"{option or config.prefix + 'activation_checkpointing'} needs layers to checkpoint: set "
            f"{config.prefix}transformer_layer_cls_to_wrap (or {config.prefix}auto_wrap_policy SIZE_BASED_WRAP)"
        )
    for unit in units:
        checkpoint(unit)
    return units


def _average_gradients(model: Any, mesh: Any = None) -> None:
    """Make the ``fully_shard`` modules in ``model`` average their gradients over ``mesh`` (1-D: FSDP; 2-D: HSDP,
    replicas x shards; default: the 1-D mesh of its sharded parameters) where the torch in use sums them: on torch 2.7
    and 2.8, gloo's ``reduce_scatter_tensor`` ignores ``ReduceOp.AVG`` (which FSDP2 uses for fp32 and bf16
    gradients) and sums, so the gradients on CPU were N times too large. Read from the torch in use: one
    reduce-scatter of ones with ``AVG`` over the shard dimension; when that is not 1, each module divides its reduced
    gradients by it in FSDP2's ``set_all_reduce_hook`` (which then replaces a hook the script set). **Collective**
    over ``mesh``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if mesh is None:
        meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
        if len(meshes) != 1 or next(iter(meshes.values())).ndim != 1:
            return  # not only FSDP's 1-D mesh (tensor parallel too): the shard dimension is not known here
        mesh = next(iter(meshes.values()))
    group = mesh.get_group(mesh.ndim - 1)
    scattered = torch.zeros(1, device=mesh.device_type)
    ones = torch.ones(dist.get_world_size(group), device=scattered.device)
    # the function FSDP2 calls: reduce_scatter_single where torch has it (reduce_scatter_tensor is deprecated there)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(scattered, ones, dist.ReduceOp.AVG, group)
    factor = float(scattered.item())
    if factor == 1.0:
        return

    def average(reduced: torch.Tensor) -> None:
        reduced.div_(factor)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(average)


# ---- optimizers -------------------------------------------------------------------------------------------------


class ParamSwap:
    """Remembers which new parameter replaced which original one (``fully_shard`` and ``parallelize_module`` both
    replace every parameter), so that optimizers built on the originals can be pointed at the new ones, also an
    optimizer prepared in a later ``prepare`` call. Local."""

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
            if new is not None:
                self.owner[id(new)] = model
            if new is not None and new is not old:
                self._map[id(old)] = (weakref.ref(old), new)

    def new_param(self, param: Any) -> Any:
        entry = self._map.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return param

    def swap(self, optimizer: torch.optim.Optimizer, plugin: str) -> list[Any]:
        """Point ``optimizer`` at the new parameters, in place. Returns the models its parameters belong to.
        ``plugin`` names the plugin in the message refusing an optimizer that already took a step."""
        groups = optimizer.param_groups
        if any(optimizer.state.get(p) for g in groups for p in g["params"]):
            raise UsageError(
                f"the optimizer already has state (it took a step before prepare); with --plugin {plugin}, "
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


# ---- gradients --------------------------------------------------------------------------------------------------


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    group: Any = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded models: clip by the global norm over all processes and return
    that norm (before clipping). **Collective** over the meshes of the gradients, and over ``group`` when given: a
    process group whose processes hold *different* parameters (pipeline stages), whose norms are combined too.

    Gradients are grouped by mesh and placements (FSDP shards; tensor-parallel layers live on a larger mesh than
    the rest; plain tensors are replicated and count once). Each group's norm is computed with ``foreach`` kernels
    and made whole with ``full_tensor()``; the groups' norms are combined (``max`` for the inf norm) and each group
    is scaled with ``foreach`` (DTensor refuses one ``foreach`` over tensors on different meshes). A non-finite
    total raises with ``error_if_nonfinite``, as torch's does; otherwise the gradients become non-finite too."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for p in parameters:
        grad = p.grad
        if grad is not None:
            key = (id(grad.device_mesh), tuple(grad.placements)) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    if not groups and group is None:
        return torch.tensor(0.0)
    norms = []
    for params in groups.values():
        norm = get_total_norm([g for p in params if (g := p.grad) is not None], norm_type, foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1 and group is None:
        total = norms[0]
    else:
        parts = torch.stack([n.to(norms[0].device, torch.float32) for n in norms]) if norms else torch.zeros(1)
        inf = norm_type == float("inf")
        total = parts.max() if inf else parts.pow(norm_type).sum()
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        total = total if inf else total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    for params in groups.values():
        clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total


@contextlib.contextmanager
def _skip_gradient_sync(model: Any) -> Iterator[None]:
    """Accumulate unsharded gradients locally: no reduce-scatter in the backward passes inside. Local."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---- checkpoint items -------------------------------------------------------------------------------------------


def _state_options(full: bool, broadcast: bool = False, flatten: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if not full:
        return StateDictOptions(flatten_optimizer_state_dict=flatten)
    if broadcast:
        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def dcp_save(state: dict[str, Any], path: Path) -> None:
    """torch.distributed.checkpoint's save into directory ``path``. **Collective**: a failure on any process
    raises :class:`~accel.CheckpointError` (one line) on every process."""
    import torch.distributed.checkpoint as dcp

    from accel.checkpoint import error_line

    try:
        dcp.save(state, checkpoint_id=path)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise CheckpointError(f"cannot write {path}: {error_line(exc)}") from None


def save_model(kernel: KernelView, model: nn.Module, key: str, directory: Path, full: bool, plugin: str) -> ItemRecord:
    """Write ``model`` as item ``key``: a DCP directory ``key/`` (every process writes its shards; loads on any
    number of processes) or, with ``full``, ``key.safetensors`` gathered on the main process. **Collective**."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from accel.checkpoint import agree

    state = get_model_state_dict(model, options=_state_options(full))  # collective
    if not full:
        dcp_save(state, directory / key)
        return ItemRecord(plugin=plugin, format=DCP_FORMAT, files=(key,))
    name = f"{key}.safetensors"

    def write() -> None:
        if kernel.is_main_process:
            from safetensors.torch import save_file

            tensors = cast("dict[str, torch.Tensor]", state)  # a full state dict holds plain tensors
            save_file(_unshare(tensors), str(directory / name), metadata={"format": "pt"})

    agree(kernel, f"save_state (writing {name})", write)  # before the next item's collectives
    return ItemRecord(plugin=plugin, format=FULL_MODEL_FORMAT, files=(name,))


def load_model(kernel: KernelView, model: nn.Module, key: str, directory: Path, record: ItemRecord) -> None:
    """Load item ``key`` (written by :func:`save_model` in either format) into ``model``, resharding it onto this
    run's mesh. **Collective**."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from accel.checkpoint import agree, dcp_load

    if record.format == DCP_FORMAT:
        state = get_model_state_dict(model)
        dcp_load(state, directory / key)
        set_model_state_dict(model, state)
    elif record.format == FULL_MODEL_FORMAT:
        import torch

        expected = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
        path = directory / record.files[0]

        def read() -> dict[str, Any]:
            if not kernel.is_main_process:
                return {}
            from safetensors.torch import load_file

            try:
                state = load_file(str(path))
            except Exception as exc:
                raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
            _check_full_model(key, state, expected)
            return state

        # the main process reads and checks; every process learns whether that worked before the broadcast
        state = agree(kernel, f"load_state (reading {path.name})", read)
        set_model_state_dict(model, state, options=_state_options(True, broadcast=True))
    else:
        _unknown_format(key, record)


def _unknown_format(key: str, record: ItemRecord) -> None:
    raise UsageError(
        f"checkpoint item {key!r} has format {record.format!r}, which accel-plugin-{record.plugin} does not read"
    )


def _check_full_model(key: str, state: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    problems = [f"{k} is missing from the checkpoint" for k in expected if k not in state]
    problems += [f"{k} is in the checkpoint but not in this model" for k in state if k not in expected]
    problems += [
        f"{k} has shape {tuple(state[k].shape)} in the checkpoint, {expected[k]} in this model"
        for k in expected
        if k in state and tuple(state[k].shape) != expected[k]
    ]
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise CheckpointError(f"checkpoint item {key!r} does not fit this model: {'; '.join(problems[:6])}{more}")


def save_optimizer(
    kernel: KernelView,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    key: str,
    directory: Path,
    full: bool,
    plugin: str,
    *,
    flatten: bool = False,
) -> ItemRecord:
    """Write the state of ``optimizer`` (which steps ``model``) as item ``key``: a DCP directory, or with ``full``
    ``key.pt`` (plain tensors and numbers) on the main process. Whether it had taken a step is kept (:data:`FRESH`),
    so saving before the first step changes nothing. ``flatten``: the DCP directory keeps the parameter groups per
    parameter name (``param_groups.<name>.lr``), needed when processes hold different parameters (pipeline
    stages); :func:`load_optimizer` reads either layout. **Collective**."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from accel.checkpoint import agree

    # torch fills an empty optimizer state with a zero-learning-rate step to learn its layout; undo that, so that
    # saving before the first step changes nothing, and store the fact (loading empties the state again).
    fresh = not optimizer.state
    options = _state_options(full, flatten=flatten)
    state: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=options))
    if fresh:
        optimizer.state.clear()
    state[FRESH] = fresh
    if flatten and not full:
        state[_FLAT] = True
    if not full:
        dcp_save(state, directory / key)
        return ItemRecord(plugin=plugin, format=DCP_FORMAT, files=(key,))
    name = f"{key}.pt"

    def write() -> None:
        if kernel.is_main_process:
            import torch

            torch.save(state, directory / name)

    agree(kernel, f"save_state (writing {name})", write)
    return ItemRecord(plugin=plugin, format=FULL_OPTIM_FORMAT, files=(name,))


def load_optimizer(
    kernel: KernelView,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    key: str,
    directory: Path,
    record: ItemRecord,
) -> None:
    """Load item ``key`` (written by :func:`save_optimizer`, or a DCP directory without the :data:`FRESH` entry)
    into ``optimizer``, resharding it onto this run's mesh. **Collective**."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from accel.checkpoint import agree, dcp_load, dcp_reader, load_weights_only

    if record.format == DCP_FORMAT:
        saved = dcp_reader(directory / key).read_metadata().state_dict_metadata
        options = _state_options(False, flatten=_FLAT in saved)
        state: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=options))
        for marker in (FRESH, _FLAT):
            if marker in saved:
                state[marker] = False
        dcp_load(state, directory / key)
        state.pop(_FLAT, None)
        fresh = bool(state.pop(FRESH, False))
        set_optimizer_state_dict(model, optimizer, state, options=options)
    elif record.format == FULL_OPTIM_FORMAT:
        path = directory / record.files[0]
        groups = [len(g["params"]) for g in optimizer.param_groups]

        def read() -> tuple[dict[str, Any], bool]:
            if not kernel.is_main_process:
                return {}, False
            loaded = load_weights_only(path)
            _check_full_optimizer(key, loaded, groups)
            return loaded, bool(loaded.pop(FRESH, False))

        # the main process reads and checks; every process learns whether that worked before the broadcast
        state, fresh = agree(kernel, f"load_state (reading {path.name})", read)
        set_optimizer_state_dict(model, optimizer, state, options=_state_options(True, broadcast=True))
        fresh = bool(kernel.collectives.broadcast_object(fresh, 0))
    else:
        _unknown_format(key, record)
    if fresh:
        optimizer.state.clear()


def _check_full_optimizer(key: str, state: Any, groups: list[int]) -> None:
    if (
        not isinstance(state, dict)
        or not isinstance(state.get("state"), dict)
        or not isinstance(state.get("param_groups"), list)
    ):
        raise CheckpointError(f"checkpoint item {key!r} is not an optimizer state (no 'state'/'param_groups')")
    saved = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in state["param_groups"]]
    if saved != groups:
        raise CheckpointError(
            f"checkpoint item {key!r} does not fit this optimizer: parameters per group {saved} in "
            f"the checkpoint, {groups} in this run"
        )


def detect_record(directory: Path, key: str, plugin: str) -> ItemRecord | None:
    """The record of item ``key`` from the files alone (for :func:`load_sharded`, which does not read the
    manifest); None when there is no such item. Local."""
    if (directory / key / ".metadata").is_file():
        return ItemRecord(plugin=plugin, format=DCP_FORMAT, files=(key,))
    if (directory / f"{key}.safetensors").is_file():
        return ItemRecord(plugin=plugin, format=FULL_MODEL_FORMAT, files=(f"{key}.safetensors",))
    if (directory / f"{key}.pt").is_file():
        return ItemRecord(plugin=plugin, format=FULL_OPTIM_FORMAT, files=(f"{key}.pt",))
    return None


def _unshare(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out


# ---- the strategy component -------------------------------------------------------------------------------------


class ShardedStrategy(ProcessGroupComponent):
    """A strategy component that shards models with ``fully_shard`` (and whatever else the subclass applies): it
    answers prepare (sharding each model once, then pointing the optimizers at the new parameters), ``no_sync``,
    gradient clipping, the full state dict, ``save_state``/``load_state`` of its models and optimizers, and bf16
    (realised by FSDP's ``MixedPrecisionPolicy``, so no precision plugin takes part).

    A subclass sets up its mesh in ``accel_setup`` (after :meth:`start_process_group`) and implements
    :meth:`shard`; it may override :meth:`full_state_dict`. Messages name the plugin (``--plugin <name>``)."""

    role = "strategy"
    provides = frozenset({"distributed", "sharding", "precision:bf16"})

    def __init__(self, settings: Settings):
        self.settings = settings
        self.owns_process_group = False
        self.swap = ParamSwap()
        self.models: list[Any] = []  # the models this strategy prepared
        self.optimizer_models: dict[int, list[Any]] = {}  # id(optimizer) -> the prepared models it steps

    # ---- to implement -----------------------------------------------------------------------------------------

    def shard(self, kernel: KernelView, model: nn.Module) -> None:
        """Shard ``model`` in place (e.g. with :func:`shard_model`). **Collective**."""
        raise NotImplementedError

    def full_state_dict(self) -> bool:
        """Whether ``save_state`` writes full state dicts on the main process instead of DCP directories."""
        return False

    def flatten_optimizer_state(self) -> bool:
        """Whether optimizer DCP directories keep parameter groups per parameter name (``save_optimizer``'s
        ``flatten``): needed when processes hold different parameters (pipeline stages)."""
        return False

    # ---- process start-up -------------------------------------------------------------------------------------

    def start_process_group(self) -> None:
        """Set ``local_rank``, ``local_world`` and ``device`` from torchrun's variables (or a world of one), and
        start the default process group unless one exists. **Collective** over every process of the run."""
        import torch.distributed as dist

        torchrun_env(os.environ)
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.device = local_device(self.local_rank, self.settings["cpu"])
        if not dist.is_initialized():
            timeout = timedelta(seconds=TIMEOUT_S)
            dist.init_process_group(
                backend=dist.get_default_backend_for_device(self.device),
                timeout=timeout,
                device_id=self.device if self.device.type != "cpu" else None,
                **restart_store_args(os.environ, timeout, f"accel-{self.name}"),
            )
            self.owns_process_group = True

    @hookimpl
    def accel_autocast(self, kernel: KernelView) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
        # bf16 (declared in provides, so the kernel left the precision plugin out) is realised by
        # MixedPrecisionPolicy inside fully_shard: no autocast, but prepared models still return fp32 outputs.
        return contextlib.nullcontext if self.settings.mixed_precision == "bf16" else None

    # ---- prepare and training step ----------------------------------------------------------------------------

    @hookimpl
    def accel_prepare_training(
        self, kernel: KernelView, models: list[Any], optimizers: list[Any], schedulers: list[Any]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        from torch.distributed.fsdp import FSDPModule

        for model in models:
            if any(model is m for m in self.models):
                continue  # prepared before
            before = self.swap.record(model)
            if not isinstance(model, FSDPModule):
                self.shard(kernel, model)
            else:  # sharded by the script itself: keep it as it is, but make its gradients averages
                _average_gradients(model)
            self.swap.update(model, before)
            self.models.append(model)
        for optimizer in optimizers:
            self.optimizer_models[id(optimizer)] = self.swap.swap(optimizer, self.name)
        return list(models), list(optimizers), list(schedulers)

    @hookimpl
    def accel_no_sync(
        self, kernel: KernelView, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[Any] | None:
        from torch.distributed.fsdp import FSDPModule

        module = self.model_of(kernel, model)
        if module is None:
            return None
        return _skip_gradient_sync(module) if isinstance(module, FSDPModule) else contextlib.nullcontext()

    @hookimpl
    def accel_clip_grad_norm(
        self, kernel: KernelView, parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        return clip_grad_norm(parameters, max_norm, norm_type)

    # ---- state ------------------------------------------------------------------------------------------------

    def model_of(self, kernel: KernelView, obj: Any) -> Any | None:
        """The user's module of ``obj`` when it is a model this strategy prepared, else None."""
        from torch import nn

        if not isinstance(obj, nn.Module):
            return None
        module = kernel.unwrap_model(obj)
        return module if any(module is m for m in self.models) else None

    def optimizer_model(self, key: str, obj: Any) -> tuple[Any, Any] | None:
        """(the user's optimizer, the one prepared model it steps) for an optimizer this strategy prepared."""
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
                f"models; with --plugin {self.name} use one optimizer per model"
            )
        return inner, models[0]

    @hookimpl
    def accel_model_state_dict(self, kernel: KernelView, model: torch.nn.Module) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        module = self.model_of(kernel, model)
        if module is None:
            return None
        state = get_model_state_dict(module, options=_state_options(full=True))  # collective
        return state if kernel.is_main_process else {}

    @hookimpl
    def accel_save_state(
        self, kernel: KernelView, items: Mapping[str, Any], directory: Path, asynchronous: bool
    ) -> dict[str, ItemRecord]:
        mine = {k: v for k, v in items.items() if self.model_of(kernel, v) is not None or self.optimizer_model(k, v)}
        if not mine:
            return {}
        if asynchronous:
            raise UsageError(
                f"save_state(asynchronous=True) is not supported with --plugin {self.name}: its checkpoints are "
                "written by torch.distributed.checkpoint, whose collectives must run on the training "
                "thread; call save_state() without asynchronous=True (and async_save: false)"
            )
        if not kernel.sync_gradients:
            raise UsageError(
                f"save_state in the middle of gradient accumulation is not supported with --plugin {self.name} "
                "(FSDP keeps the partial gradients unsharded, outside the parameters); save on a step "
                "that synchronises (if kernel.sync_gradients: ...)"
            )
        full = self.full_state_dict()
        records: dict[str, ItemRecord] = {}
        for key in sorted(mine):  # the same order on every rank: each save is a collective
            model = self.model_of(kernel, mine[key])
            if model is not None:
                records[key] = save_model(kernel, model, key, Path(directory), full, self.name)
                continue
            optimizer, model = cast("tuple[Any, Any]", self.optimizer_model(key, mine[key]))
            records[key] = save_optimizer(
                kernel, model, optimizer, key, Path(directory), full, self.name, flatten=self.flatten_optimizer_state()
            )
        return records

    @hookimpl
    def accel_load_state(
        self, kernel: KernelView, items: Mapping[str, Any], directory: Path, records: Mapping[str, ItemRecord]
    ) -> Iterable[str]:
        mine = {k: rec for k, rec in records.items() if rec.plugin == self.name}
        missing = sorted(k for k in mine if k not in items)
        if missing:
            raise UsageError(
                f"the checkpoint holds {missing} (written by accel-plugin-{self.name}) but this run did not "
                "prepare them"
            )
        self.load_items(kernel, Path(directory), {k: items[k] for k in mine}, mine)
        return sorted(mine)

    def load_items(
        self,
        kernel: KernelView,
        directory: Path,
        objects: Mapping[str, Any],
        records: Mapping[str, ItemRecord] | None = None,
    ) -> None:
        """Restore models and optimizers by item key, resharding onto this run's mesh; records default to what the
        files show. **Collective**."""
        for key in sorted(objects):  # the same order on every rank: each load is a collective
            record = records[key] if records is not None else detect_record(directory, key, self.name)
            if record is None:
                raise UsageError(f"{directory} has no item {key!r} written by accel-plugin-{self.name}")
            obj = objects[key]
            model = self.model_of(kernel, obj)
            pair = None if model is not None else self.optimizer_model(key, obj)
            if model is not None:
                load_model(kernel, model, key, directory, record)
            elif pair is not None:
                load_optimizer(kernel, pair[1], pair[0], key, directory, record)
            else:
                raise UsageError(
                    f"checkpoint item {key!r} was written by accel-plugin-{self.name}, but in this run "
                    f"{key!r} is not a model or optimizer prepared with --plugin {self.name}"
                )


def load_sharded(
    kernel: KernelView,
    directory: str | os.PathLike[str],
    *,
    model: Any,
    optimizer: Any = None,
    model_key: str = "model",
    optimizer_key: str = "optimizer",
    plugin: str = "",
) -> None:
    """Load only a model (and its optimizer) from a checkpoint that ``save_state`` wrote with a
    :class:`ShardedStrategy` plugin, on any number of processes (any mesh, one process included):
    torch.distributed.checkpoint reshards them. Use it to continue on a different number of processes than the run
    that saved (``load_state`` restores everything, including per-process random states and dataloader positions,
    so it needs the same number). Call it on every process after ``prepare``: **collective**. The keys are the
    checkpoint's item names (``model``, ``optimizer``, ``model_1``, ...); ``plugin`` names the plugin that must be
    running (any sharded strategy when empty). A run without a sharding strategy (one plain process, DDP) loads
    the full values into every process's whole model and optimizer."""
    objects = {model_key: model, **({optimizer_key: optimizer} if optimizer else {})}
    sharding = [c for c in kernel.components if isinstance(c, ShardedStrategy)]
    comp = next((c for c in sharding if plugin in ("", c.name)), None)
    if comp is not None:
        comp.load_items(kernel, Path(directory), objects)
        return
    if sharding:  # another sharding strategy: its items would be asked for under its name
        raise UsageError(
            f"load_sharded of plugin {plugin!r} needs a Kernel running with --plugin {plugin}, or with no "
            f"sharding strategy (this one runs {sharding[0].name!r}; use its own load_sharded)"
        )
    load_whole(kernel, Path(directory), objects, model_key, plugin)


def load_whole(
    kernel: KernelView, directory: Path, objects: Mapping[str, Any], model_key: str, plugin: str = ""
) -> None:
    """``load_sharded`` in a run that does not shard (one plain process, DDP): the checkpoint's full values into each
    process's whole model and its optimizer (the first object is the model). **Collective**."""
    import warnings

    import torch

    model = kernel.unwrap_model(objects[model_key])
    for key in sorted(objects):  # the same order on every rank: each load is a collective
        record = detect_record(directory, key, plugin)
        if record is None:
            raise UsageError(f"{directory} has no item {key!r} of a sharded checkpoint (a directory or file {key}.*)")
        obj = objects[key]
        if not (key == model_key or isinstance(obj, torch.optim.Optimizer)):
            raise UsageError(f"load_sharded: {key!r} is a {type(obj).__name__}, not an optimizer")
        with warnings.catch_warnings():  # one plain process: DCP says it loads without a process group, as meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            if key == model_key:
                load_model(kernel, model, key, directory, record)
            else:
                load_optimizer(kernel, model, getattr(obj, "optimizer", obj), key, directory, record)
