"""The items of a checkpoint: what the run has (``accel_state_items``), the kernel's own per-run state (random
states, the gradient-accumulation position, gradients pending in the middle of accumulation), and how the kernel
calls the state hooks (:func:`call_by_owner`).
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from accel.contract import KernelView
from accel.dispatch import each_implementation
from accel.errors import CheckpointError, PluginError
from accel.options import KERNEL

if TYPE_CHECKING:
    import pluggy

    from accel.data import GradientState, PreparedDataLoader
    from accel.prepared import PreparedOptimizer, PreparedScheduler
    from accel.project import ProjectConfiguration


class InstalledPlugin(Protocol):
    """What the checkpoint code reads of an installed plugin's record (:class:`accel.plugins.PluginRecord`)."""

    @property
    def name(self) -> str: ...

    @property
    def distribution(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def reason(self) -> str: ...


class PluginTable(Protocol):
    """What the checkpoint code reads of the Kernel's :class:`accel.plugins.Plugins`."""

    @property
    def pm(self) -> pluggy.PluginManager: ...

    @property
    def records(self) -> Mapping[str, InstalledPlugin]: ...

    @property
    def builtin(self) -> Sequence[InstalledPlugin]: ...


class CheckpointPart(Protocol):
    """What the checkpoint code reads of a Kernel's checkpoint part (:class:`accel.builtin.checkpoint.Checkpoints`):
    the objects registered for checkpointing and the script's save and load hooks, by handle id."""

    custom_objects: list[Any]
    save_hooks: dict[int, Any]
    load_hooks: dict[int, Any]


class CheckpointKernel(KernelView, Protocol):
    """What the kernel's checkpoint code uses of the Kernel beyond :class:`accel.contract.KernelView`: the objects
    it prepared, its plugins and its project configuration."""

    gradient_state: GradientState

    @property
    def plugins(self) -> PluginTable: ...

    project_configuration: ProjectConfiguration
    _models: list[torch.nn.Module]
    _optimizers: list[PreparedOptimizer]
    _schedulers: list[PreparedScheduler]
    _dataloaders: list[PreparedDataLoader]
    _checkpoints: CheckpointPart

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, Any]: ...


RESERVED = ("gradients", "rng", "kernel")  # item keys of the kernel's own per-run state


class RNGState:
    """The random states of this process: python, numpy, torch CPU and every device of the current accelerator
    (through ``torch.accelerator`` and the accelerator's device module, whatever its type), and the states the
    prepared dataloaders need to replay their current pass (``rng_state_dict``: per process, like the others)."""

    def __init__(self, loaders: Sequence[Any] = ()):
        self.loaders = [dl for dl in loaders if callable(getattr(dl, "rng_state_dict", None))]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if self.loaders:
            state["dataloaders"] = [dl.rng_state_dict() for dl in self.loaders]
        try:
            import numpy as np

            state["numpy"] = np.random.get_state()
        except ImportError:  # pragma: no cover - numpy is a dependency
            pass
        acc = _accelerator_module()
        if acc is not None:
            kind, module = acc
            if hasattr(module, "get_rng_state_all"):
                states = list(module.get_rng_state_all())
            else:
                states = [module.get_rng_state()]
            state["accelerator"] = {"type": kind, "states": states}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
        for loader, loader_state in zip(self.loaders, state.get("dataloaders", ()), strict=False):
            loader.load_rng_state_dict(loader_state)
        saved = state.get("accelerator")
        if saved is None:
            return
        acc = _accelerator_module()
        if acc is None or acc[0] != saved["type"]:
            warnings.warn(
                f"the checkpoint holds random states of {saved['type']} devices, which this run does not "
                "use; they are not restored",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        _, module = acc
        states = list(saved["states"])
        if hasattr(module, "set_rng_state_all"):
            count = torch.accelerator.device_count()
            if count != len(states):
                warnings.warn(
                    f"the checkpoint holds random states of {len(states)} {saved['type']} devices, this "
                    f"machine has {count}; restoring the first {min(count, len(states))}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            for index, st in enumerate(states[:count]):
                module.set_rng_state(st, index)
        else:
            module.set_rng_state(states[0])


def _accelerator_module() -> tuple[str, Any] | None:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    kind = accelerator.current_accelerator().type
    try:
        module = torch.get_device_module(kind)
    except Exception:
        return None
    if not hasattr(module, "get_rng_state"):
        return None
    return kind, module


class KernelState:
    """The Kernel's own position: the gradient-accumulation micro-step counter and whether the last micro-step
    synchronised."""

    def __init__(self, kernel: CheckpointKernel):
        self.kernel = kernel

    def state_dict(self) -> dict[str, Any]:
        state = self.kernel.gradient_state
        return {"accumulation_step": state.step, "sync_gradients": state.sync_gradients}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kernel.gradient_state.step = int(state["accumulation_step"])
        self.kernel.gradient_state.sync_gradients = bool(state.get("sync_gradients", True))


class GradientsState:
    """Gradients accumulated since the last optimizer step, per process (under DDP's ``no_sync`` they differ
    between processes). Saved only when the last micro-step did not synchronise (``save_state`` in the middle
    of gradient accumulation); otherwise empty, so checkpoints taken on optimizer steps carry no gradients."""

    def __init__(self, kernel: CheckpointKernel):
        self.kernel = kernel

    def _parameters(self) -> dict[str, torch.nn.Parameter]:
        return {
            f"{i}.{name}": p
            for i, m in enumerate(self.kernel._models)
            for name, p in self.kernel.unwrap_model(m).named_parameters()
        }

    def state_dict(self) -> dict[str, Any]:
        grads: dict[str, torch.Tensor] = {}
        if not self.kernel.gradient_state.sync_gradients:
            for name, p in self._parameters().items():
                if p.grad is None:
                    continue
                if type(p.grad) is not torch.Tensor:
                    raise CheckpointError(
                        f"save_state in the middle of gradient accumulation: the gradient of {name} is a "
                        f"{type(p.grad).__name__}, which the kernel cannot store; save on a step that synchronises "
                        "(if kernel.sync_gradients: ...) or use a strategy plugin that claims the 'gradients' item"
                    )
                grads[name] = p.grad
        return {"grads": grads}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        grads = state["grads"]
        params = self._parameters()
        unknown = sorted(set(grads) - set(params))
        if unknown:
            raise CheckpointError(f"the checkpoint holds gradients of parameters this run does not have: {unknown[:5]}")
        for name, p in params.items():
            g = grads.get(name)
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).reshape(p.shape)


@dataclass
class Item:
    """One thing a checkpoint holds. ``kind``: model, optimizer, scheduler, dataloader, custom, plugin, rng,
    kernel. ``per_rank`` items hold one state per process; the others are written by the main process."""

    key: str
    obj: Any
    kind: str
    per_rank: bool = False
    provider: str = KERNEL
    #: a model's state dict taken already in this save (for the script's save hooks): written as it is, as Accelerate
    #: writes the ``weights`` its hooks saw, instead of being taken again (a sharding strategy gathers to take it)
    state: Any = field(default=None, repr=False, compare=False)


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def kernel_items(kernel: CheckpointKernel) -> dict[str, Any]:
    """The kernel's own answer to ``accel_state_items`` (its default implementation, called last): ``model``,
    ``model_1``, ..., ``optimizer``..., ``scheduler``..., ``dataloader``..., ``custom_<i>``
    (``register_for_checkpointing``), ``gradients`` and ``rng`` (per process) and ``kernel``."""
    items: dict[str, Any] = {}
    loaders = [dl for dl in kernel._dataloaders if _stateful(dl)]
    for kind, objs in (
        ("model", kernel._models),
        ("optimizer", kernel._optimizers),
        ("scheduler", kernel._schedulers),
        ("dataloader", loaders),
    ):
        for i, obj in enumerate(objs):
            items[kind if i == 0 else f"{kind}_{i}"] = obj
    for i, obj in enumerate(kernel._checkpoints.custom_objects):
        items[f"custom_{i}"] = obj
    items["gradients"] = GradientsState(kernel)
    items["rng"] = RNGState(loaders)
    items["kernel"] = KernelState(kernel)
    return items


_KERNEL_KEY = re.compile(r"^(model|optimizer|scheduler|dataloader|custom)(_\d+)?$")


def _kernel_item(key: str, obj: Any) -> Item:
    """The :class:`Item` of one of the kernel's own keys (see :func:`kernel_items`)."""
    if key in RESERVED:
        return Item(key, obj, key, per_rank=key != "kernel")
    match = _KERNEL_KEY.match(key)
    if match is None:
        raise PluginError(f"the kernel's accel_state_items answered an unknown key {key!r}")
    return Item(key, obj, match.group(1))


def collect_items(kernel: CheckpointKernel) -> dict[str, Item]:
    """Every item of this run by key, from ``accel_state_items``: each plugin's keys, then the kernel's own
    (:func:`kernel_items`). A key given twice is an error naming both givers."""
    items: dict[str, Item] = {}
    for name, answers in call_by_owner(kernel, "accel_state_items", lambda owner: {"kernel": kernel}):
        for answer in answers:
            for key, obj in (answer or {}).items():
                if key in items or (name != KERNEL and key in RESERVED):
                    other = items[key].provider if key in items else KERNEL
                    first, second = (name, other) if name == KERNEL else (other, name)
                    raise PluginError(f"checkpoint item {key!r} is given by both {first!r} and {second!r}")
                if not _stateful(obj):
                    raise PluginError(f"plugin {name!r}: checkpoint item {key!r} has no state_dict/load_state_dict")
                items[key] = _kernel_item(key, obj) if name == KERNEL else Item(key, obj, "plugin", provider=name)
    return items


def call_by_owner(
    kernel: CheckpointKernel, hook: str, arguments: Callable[[str], Mapping[str, Any] | None]
) -> Iterator[tuple[str, list[Any]]]:
    """Call ``hook`` through pluggy once per component that implements it, in pluggy's order (the kernel's own
    default last), so that each answer is known to be that component's: ``(component name, answers)``.
    ``arguments(name)`` gives the call's keyword arguments, or None to skip that component. The calls are
    :func:`accel.dispatch.each_implementation`'s (that implementation plus every wrapper of the hook), so wrappers
    wrap each component's call and see its answer, and pluggy's tracing and monitoring see the calls."""
    builtin = builtin_names(kernel)
    for one in each_implementation(kernel.plugins.pm, hook):
        name = _component_name(one.impl, builtin)
        kwargs = arguments(name)
        if kwargs is None:
            continue
        answer = one(**kwargs)
        yield name, [] if answer is None else [answer]


def builtin_names(kernel: CheckpointKernel) -> set[str]:
    """The names under which the Kernel's built-in plugins are registered (they answer as the kernel)."""
    return {record.name for record in kernel.plugins.builtin}


def _component_name(impl: Any, builtin: Collection[str]) -> str:
    """The component's name; the kernel's (``"accel"``) for a built-in plugin (the checkpoint writer)."""
    if impl.plugin_name in builtin:
        return KERNEL
    return getattr(impl.plugin, "name", "") or impl.plugin_name.split(":")[0]


def _state_of(kernel: CheckpointKernel, item: Item) -> Any:
    if item.state is not None:
        return item.state
    if item.kind == "model":
        return kernel.get_state_dict(item.obj)
    return item.obj.state_dict()


def _file_stem(item: Item, rank: int) -> str:
    return f"{item.key}_rank{rank}" if item.per_rank else item.key
