"""Built-in plugin ``accel.checkpoint``: the checkpoint writer, the default implementation of the state hooks, and
the Kernel's checkpoint part (:class:`Checkpoints`: ``kernel.save_state``, ``load_state``, ``save_model``...).

It gives the kernel's own items (prepared models, optimizers, schedulers, dataloader positions, registered objects,
random states), writes every item no plugin claimed and reads them back, in the kernel's own format
(:mod:`accel.checkpoint`). Its items and records belong to the kernel (``"accel"`` in the manifest)."""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel.contract import ItemRecord
from accel.errors import UsageError
from accel.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch

    from accel.checkpoint.items import CheckpointKernel


@hookimpl(trylast=True)
def accel_state_items(kernel: CheckpointKernel) -> dict[str, Any]:
    from accel.checkpoint import kernel_items

    return kernel_items(kernel)


@hookimpl(trylast=True)
def accel_save_state(
    kernel: CheckpointKernel, items: Mapping[str, Any], directory: Path, asynchronous: bool
) -> dict[str, ItemRecord]:
    # called last, once the plugins' claims are agreed between processes: writes every item nobody claimed
    from accel.checkpoint import write_unclaimed

    return write_unclaimed(kernel, directory, asynchronous)


@hookimpl(trylast=True)
def accel_load_state(
    kernel: CheckpointKernel, items: Mapping[str, Any], directory: Path, records: Mapping[str, ItemRecord]
) -> list[str]:
    from accel.checkpoint import restore_own

    return restore_own(kernel, items, directory, records)


class Checkpoints:
    """A Kernel's checkpoint part (its ``_checkpoints``; the Kernel offers each public member under the same name,
    documented in :class:`accel.parts.CheckpointPart`):
    what the script registered for checkpointing, and the calls into :mod:`accel.checkpoint`, imported on first use
    (a run that never saves does not pay for it)."""

    def __init__(self, kernel: CheckpointKernel) -> None:
        self.kernel = kernel
        self.custom_objects: list[Any] = []
        # ordered dicts, as torch's RemovableHandle holds them by weak reference (accel.checkpoint.user_hooks)
        self.save_hooks: dict[int, Any] = collections.OrderedDict()
        self.load_hooks: dict[int, Any] = collections.OrderedDict()

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = True) -> None:
        if not self.kernel.is_main_process:
            return
        import torch

        if (
            safe_serialization
            and isinstance(obj, Mapping)
            and obj
            and all(isinstance(v, torch.Tensor) for v in obj.values())
        ):
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().cpu() for k, v in obj.items()}, os.fspath(f))
        else:
            torch.save(obj, f)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        return self.kernel.plugins.pm.hook.accel_model_state_dict(kernel=self.kernel, model=model)

    def register_for_checkpointing(self, *objects: Any) -> None:
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise UsageError(
                    f"register_for_checkpointing: {type(obj).__name__} has no state_dict() and "
                    "load_state_dict(); only such objects can be checkpointed"
                )
        self.custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        return _handle(self.save_hooks, hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        return _handle(self.load_hooks, hook)

    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, asynchronous: bool | None = None
    ) -> os.PathLike[str]:
        from accel import checkpoint

        return checkpoint.save_state(self.kernel, output_dir, asynchronous)

    def wait_for_save(self) -> None:
        self.finish()

    def finish(self, at_exit: bool = False, release: bool = False) -> None:
        """Finish the asynchronous save in flight, if any (``at_exit``: without collectives; ``release``: the
        saving threads end)."""
        checkpoint = sys.modules.get("accel.checkpoint")  # not imported: this run never saved
        if checkpoint is not None:
            checkpoint.finish_pending(self.kernel, at_exit=at_exit, release=release)

    def exit_if_lost(self) -> None:
        """At interpreter exit, once the process's last Kernel ended: exit code 1 if an asynchronous save was lost."""
        checkpoint = sys.modules.get("accel.checkpoint")
        if checkpoint is not None:
            checkpoint.exit_if_lost()

    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> os.PathLike[str]:
        from accel import checkpoint

        checkpoint.finish_pending(self.kernel)
        return checkpoint.load_state(self.kernel, input_dir)

    def latest_checkpoint(self) -> os.PathLike[str] | None:
        from accel import checkpoint

        kernel = self.kernel
        checkpoint.finish_pending(kernel)
        project = kernel.project_configuration.project_dir
        found = checkpoint.latest_checkpoint(project) if (project and kernel.is_main_process) else None
        found = kernel.collectives.broadcast_object(None if found is None else os.fspath(found), 0)
        return None if found is None else Path(found)

    @property
    def save_iteration(self) -> int:
        return self.kernel.project_configuration.iteration

    def save_model(
        self, model: torch.nn.Module, save_directory: str | os.PathLike[str], max_shard_size: int | str = "10GB"
    ) -> list[os.PathLike[str]]:
        from accel import checkpoint

        return list(checkpoint.save_model(self.kernel, model, save_directory, max_shard_size))


def _handle(hooks: dict[int, Any], hook: Callable[..., None]) -> Any:
    """Register ``hook`` in ``hooks`` under a torch ``RemovableHandle``, which it returns."""
    from torch.utils.hooks import RemovableHandle

    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle
