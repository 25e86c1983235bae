"""The parts a Kernel holds that built-in features give it, and what each offers: the contract between
:mod:`accel.kernel` and those features, as :mod:`accel.hookspecs` is between the kernel and plugins.

``Kernel`` declares each public member of a part with one line (:mod:`accel.members`), typed and documented by the
protocols here; the features implement them (:class:`accel.tracking.Tracking`,
:class:`accel.builtin.checkpoint.Checkpoints`), and :data:`accel.builtin.BUILTIN_PARTS` names the implementation of
each, which the Kernel makes by name when it starts, as the built-in plugins are registered by name. So
``accel.kernel`` imports no feature: the checkpoint code is imported at the first save or load.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from accel.contract import Component


class TrackingPart(Protocol):
    """A Kernel's tracker API: :class:`accel.tracking.Tracking` (its ``_tracking``)."""

    @property
    def log_with(self) -> list[str]:
        """The trackers this run logs to (the ``log_with`` setting)."""
        ...

    @log_with.setter
    def log_with(self, value: str | Sequence[str] | None) -> None:
        """Accepted when it names the trackers this run has; trackers are plugins chosen by ``Kernel(log_with=...)``,
        so another choice is one line saying so."""
        ...

    @property
    def trackers(self) -> list[Component]:
        """The active tracker components, in the order hooks ask them."""
        ...

    @trackers.setter
    def trackers(self, value: list[Component]) -> None:
        """Accepted when it holds this run's trackers (``kernel.trackers = kernel.trackers``); trackers are plugins
        chosen by ``Kernel(log_with=...)``, so another list is one line saying so."""
        ...

    def init_trackers(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Start a run named ``project_name`` in every tracker of ``log_with`` and record ``config`` (the
        hyper-parameters). ``init_kwargs`` maps a tracker name to keyword arguments for that backend, e.g.
        ``{"my_tracker": {"project": "x"}, "other_tracker": {"uri": "http://..."}}``. Main process only, unless a
        tracker says otherwise."""
        ...

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Log a dict of values (numbers, and whatever else a tracker understands) at ``step`` to every active
        tracker. ``log_kwargs`` maps a tracker name to extra keyword arguments for its log call."""
        ...

    def log_images(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Log images to the active trackers that can show them. ``values`` maps a name to an image or a list of
        images; an image is an array or tensor of shape H x W, H x W x 3 or H x W x 4 (channels last; uint8 in
        0..255 or float in 0..1) or a PIL image."""
        ...

    def log_table(
        self,
        table_name: str,
        columns: Sequence[str] | None = None,
        data: Iterable[Sequence[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Log a table (``columns`` and rows of ``data``, or a pandas ``dataframe``) to the active trackers that can
        show tables."""
        ...

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The active tracker component called ``name``; with ``unwrap=True`` the backend's own run object
        (``None`` on processes where the tracker did not start a run, e.g. not the main process)."""
        ...


class CheckpointPart(Protocol):
    """A Kernel's checkpoint API: :class:`accel.builtin.checkpoint.Checkpoints` (its ``_checkpoints``)."""

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = True) -> None:
        """Save on the main process only: a flat dict of tensors as safetensors, anything else with torch.save."""
        ...

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The full state dict of a prepared model (gathered from shards where a plugin shards it)."""
        ...

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict``/``load_state_dict`` in ``save_state``/``load_state`` (items
        ``custom_0``, ``custom_1``, ... in registration order)."""
        ...

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """Call ``hook(models, weights, output_dir)`` at the start of every ``save_state`` (Accelerate's): files
        it writes into ``output_dir`` are part of the checkpoint; a model whose state dict it removes from
        ``weights`` is not saved by accel. Returns a handle whose ``remove()`` unregisters it."""
        ...

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """Call ``hook(models, input_dir)`` at the start of every ``load_state`` (Accelerate's): a model it removes
        from ``models`` is one it loaded itself, which accel does not restore. Returns a handle (``remove()``)."""
        ...

    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, asynchronous: bool | None = None
    ) -> os.PathLike[str]:
        """Save everything needed to resume exactly: prepared models, optimizers, schedulers and dataloader
        positions, registered objects, plugin items (grad scaler, ...), and every process's random states.
        Call it on every process. Without ``output_dir`` it writes ``project_dir/checkpoints/checkpoint_<i>``
        (see :class:`accel.ProjectConfiguration`). Atomic: the directory appears complete or not at all.
        ``asynchronous=True`` (default: the ``async_save`` option) returns once the state is copied to CPU
        memory; the write, fsync and publish happen in the background, and the next ``save_state``,
        ``load_state``, ``latest_checkpoint``, ``wait_for_save`` or ``end_training`` waits for them (and raises
        their error). Returns the checkpoint's directory."""
        ...

    def wait_for_save(self) -> None:
        """Wait until the asynchronous ``save_state`` in flight (if any) is written and published; raise its error
        (the same on every process). Call it on every process."""
        ...

    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> os.PathLike[str]:
        """Restore what ``save_state`` saved, after checking that it fits this run (plugins, items, number of
        processes, shapes). Without ``input_dir``: the newest complete checkpoint of the project. Call it on every
        process, after ``prepare``. The next pass over each prepared dataloader continues where the saved one
        stopped. Returns the directory loaded."""
        ...

    def latest_checkpoint(self) -> os.PathLike[str] | None:
        """The newest complete checkpoint of the project (as the main process sees it), or None. Call it on every
        process: ``if kernel.latest_checkpoint(): kernel.load_state()``."""
        ...

    @property
    def save_iteration(self) -> int:
        """The number the next automatic checkpoint gets."""
        ...

    def save_model(
        self, model: torch.nn.Module, save_directory: str | os.PathLike[str], max_shard_size: int | str = "10GB"
    ) -> list[os.PathLike[str]]:
        """Write a prepared model's full weights as safetensors (``model.safetensors``, or shards plus
        ``model.safetensors.index.json`` above ``max_shard_size``); tied weights are stored once. Call it on every
        process; the main process writes. Load with :func:`accel.load_model`."""
        ...
