"""``accelerate.state``: ``PartialState``, ``AcceleratorState`` and ``GradientState`` with Accelerate's shared-state
behaviour (every instance of a class sees the same state until ``_reset_state``), each backed by one
``accel.Kernel``: the last ``Accelerator`` made, else a Kernel that ``PartialState()`` makes on first use."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import accel.data
from accel import Kernel
from accel import PartialState as _View
from accel.kernel import active_kernel

#: Kernel messages about Accelerate arguments that real Accelerate accepts without a word
QUIET = r".*(change nothing in this run|changes nothing in this run)"


def kernel_for_state(cpu: bool = False, **kwargs: Any) -> Kernel:
    """The Kernel a ``PartialState(...)`` stands for: the process's active one, else a new one. ``backend`` and
    ``timeout`` (Accelerate's process-group arguments) become ``InitProcessGroupKwargs``."""
    kernel = active_kernel()
    if kernel is not None:
        return kernel
    from accel.utils import InitProcessGroupKwargs

    handler: dict[str, Any] = {}
    for name in ("backend", "timeout"):
        if kwargs.get(name) is not None:
            handler[name] = kwargs[name]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=QUIET)
        return Kernel(cpu=cpu or None, kwargs_handlers=[InitProcessGroupKwargs(**handler)] if handler else None)


class PartialState:
    """Accelerate's ``PartialState``: the process's distributed facts (device, process index and count, ...)."""

    _shared_state: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if "_kernel" not in self._shared_state:
            self._shared_state["_kernel"] = kernel_for_state(cpu, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the Kernel (``TrainingArguments`` pickles its ``distributed_state`` into every
        ``training_args.bin``): Hugging Face's accelerate loads it, and here it is this process's state again."""
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__ = self._shared_state

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._shared_state.clear()

    @property
    def _view(self) -> _View:
        return _View.of(self._shared_state["_kernel"])

    @property
    def initialized(self) -> bool:
        return "_kernel" in self._shared_state

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_kernel" not in self._shared_state:
            raise AttributeError(name)
        return getattr(self._view, name)

    @property
    def distributed_type(self) -> Any:
        from accelerate.utils import DistributedType

        chosen = self._shared_state.get("_distributed_type")
        return chosen if chosen is not None else DistributedType(self._view.distributed_type.value)

    @distributed_type.setter
    def distributed_type(self, value: Any) -> None:
        """Accelerate's is a plain attribute, which scripts set (the Accelerator then behaves as for that type
        where Accelerate's decides by it: ``join_uneven_inputs``); the processes and devices stay the run's."""
        self._shared_state["_distributed_type"] = value

    @property
    def backend(self) -> str | None:
        import torch.distributed as dist

        return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None

    @property
    def default_device(self) -> Any:
        return self._view.device

    @property
    def fork_launched(self) -> bool:
        return False

    @property
    def debug(self) -> bool:
        return self._view.debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self._shared_state["_kernel"].debug = value

    def destroy_process_group(self, group: Any = None) -> None:
        """Through the process's state, as Accelerate's ``AcceleratorState`` does: this one may have been reset."""
        kernel = self._shared_state.get("_kernel") or PartialState._shared_state.get("_kernel")
        if kernel is not None:
            _View.of(kernel).destroy_process_group(group)
        else:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group(group)

    def __repr__(self) -> str:
        return repr(self._view)


class AcceleratorState(PartialState):
    """Accelerate's ``AcceleratorState``: ``PartialState`` plus the run's configuration (precision and the
    DeepSpeed, FSDP, dynamo, Megatron-LM and parallelism plugins, as Accelerate's objects or None)."""

    _shared_state: dict[str, Any] = {}

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if "_kernel" not in self._shared_state:
            self._shared_state["_kernel"] = PartialState(cpu, **kwargs)._shared_state["_kernel"]

    def __getattr__(self, name: str) -> Any:
        if name in ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin", "parallelism_config"):
            return getattr(self._shared_state.get("_kernel"), name, None)
        if name == "dynamo_plugin":
            from accelerate.utils import TorchDynamoPlugin

            return getattr(self._shared_state.get("_kernel"), name, None) or TorchDynamoPlugin(backend="no")
        return super().__getattr__(name)

    @property
    def mixed_precision(self) -> str:
        return str(self._shared_state["_kernel"].mixed_precision)

    @property
    def is_fsdp2(self) -> bool:
        return getattr(self._shared_state.get("_kernel"), "fsdp_plugin", None) is not None


class GradientState(accel.data.GradientState):
    """Accelerate's ``GradientState`` of an ``Accelerator``: the Kernel's own, with the members libraries set."""

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        super().__init__()
        self.plugin_kwargs: dict[str, Any] = {}
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = dataclasses.asdict(gradient_accumulation_plugin)

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = bool(sync_gradients)

    def _set_end_of_dataloader(self, end_of_dataloader: bool) -> None:
        self.end_of_dataloader = bool(end_of_dataloader)

    @property
    def num_steps(self) -> int:
        return int(self.plugin_kwargs.get("num_steps", 1))

    @property
    def sync_with_dataloader(self) -> bool:
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def initialized(self) -> bool:
        return True

    @property
    def dataloader_references(self) -> Iterator[Any]:
        return iter(self.active)


__all__ = ["AcceleratorState", "GradientState", "PartialState"]
