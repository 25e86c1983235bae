"""The XLA strategy component. torch and torch_xla are imported inside methods, so ``accel plugins`` can list the
component's hooks and ``accel launch`` can start a TPU pod without them.

What it does (torch_xla 2.9 API; ``xm.xla_device`` is deprecated in favour of ``torch_xla.device``):

- device ``torch_xla.device()``; topology from ``torch_xla.runtime`` (global/local ordinal, world size, local
  process count);
- models moved to the device in ``accel_prepare_training``; moving replaces the parameters by new XLA tensors, so
  each optimizer's ``param_groups`` (and state) are pointed at the new parameters there;
- dataloaders: the kernel's shard, with torch_xla's ``MpDeviceLoader`` as the device loader (background transfer,
  ``torch_xla.sync()`` per batch);
- optimizer step ``xm.optimizer_step`` (all-reduce of gradients over replicas, then step), then ``torch_xla.sync()``
  so the step's graph runs even without the XLA loader;
- collectives ``xm.all_gather``/``xm.all_reduce``/``xm.collective_broadcast``, objects through ``xm.rendezvous``;
- bf16: ``torch.autocast("xla", dtype=torch.bfloat16)``; ``downcast_bf16`` also stores the parameters in bf16;
- checkpoints: the kernel writes the model from ``accel_model_state_dict`` (tensors copied to the CPU, so the file
  is the kernel's portable format); this component writes the items that hold XLA tensors the kernel cannot read
  (optimizers: main process only; gradients and the XLA random state: each process) as ``accel.tree`` after moving
  them to the CPU, like ``xm.save``;
- launch: ``python -m accel_xla.spawn`` (``torch_xla.launch``: one process per local device) here, or every worker
  of a TPU pod through ``gcloud compute tpus tpu-vm ssh --worker all`` (``tpu_use_cluster``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel.spi import Component, ItemRecord, LaunchPlan, Settings, Topology, UsageError, hookimpl
from accel_xla import launch as xla_launch

if TYPE_CHECKING:
    import torch

    from accel.spi import KernelView

FORMAT = "accel.tree"  # the kernel's JSON + safetensors format, written with accel.checkpoint.write_tree


@contextlib.contextmanager
def same_rng(device: Any) -> Iterator[None]:
    """Keep the XLA device's random state across the block. ``torch_xla.sync()`` advances that state (so does every
    ``xm.rendezvous``, which syncs); accel's own syncs (per batch in the loader, after each optimizer step, in
    collectives and checkpoints) are wrapped in this, so the random numbers of a run depend only on the random ops it
    traces, and a run resumed from a checkpoint draws exactly what the uninterrupted run draws. Each random op still
    advances the state when it is traced, so no two ops share a seed."""
    import torch_xla.core.xla_model as xm

    seed = xm.get_rng_state(device)
    try:
        yield
    finally:
        xm.set_rng_state(seed, device)


def sync(device: Any) -> None:
    """``torch_xla.sync()`` (run the pending graph) without touching the device's random state."""
    import torch_xla

    with same_rng(device):
        torch_xla.sync()


def _import_xla() -> Any:
    """``torch_xla`` with its submodules loaded, or a UsageError saying how to install a matching one."""
    try:
        import torch_xla
        import torch_xla.core.xla_model  # noqa: F401
        import torch_xla.runtime  # noqa: F401
    except ImportError as exc:
        from accel_xla.availability import _version, install_advice

        raise UsageError(
            f"torch_xla cannot be imported: {type(exc).__name__}: {' '.join(str(exc).split())}; "
            f"{install_advice(_version('torch'))}"
        ) from None
    return torch_xla


class XLACollectives:
    """:class:`accel.contract.Collectives` over the XLA replicas (every process calls every method)."""

    def __init__(self, world_size: int, device: Any):
        import torch_xla.core.xla_model as xm

        self.xm = xm
        self.world_size = world_size
        self.device = device
        self._tags = 0

    def _tag(self, what: str) -> str:
        self._tags += 1
        return f"accel-{what}-{self._tags}"

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        flat = tensor.unsqueeze(0) if tensor.ndim == 0 else tensor
        gathered = self.xm.all_gather(flat.contiguous(), dim=0)
        return [part.reshape(tensor.shape) for part in gathered.chunk(self.world_size, dim=0)]

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        kinds = {"sum": self.xm.REDUCE_SUM, "max": self.xm.REDUCE_MAX}
        self.xm.all_reduce(kinds[op], [tensor])  # the list form reduces in place
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.xm.collective_broadcast([tensor], root_ordinal=src)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        import pickle

        with same_rng(self.device):  # xm.rendezvous syncs
            payloads = self.xm.rendezvous(self._tag("objects"), pickle.dumps(obj))
        return [pickle.loads(p) for p in payloads]  # payloads of this run's own processes

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return self.all_gather_object(obj)[src]

    def barrier(self) -> None:
        with same_rng(self.device):
            self.xm.rendezvous(self._tag("barrier"))


class XLARandomState:
    """The seed of this process's XLA device generator (``xm.get_rng_state``/``set_rng_state``): device-side random
    ops (dropout on the XLA device) draw from it, not from torch's CPU generator, which the kernel saves."""

    def __init__(self, device: Any):
        self.device = device

    def state_dict(self) -> dict[str, int]:
        import torch_xla.core.xla_model as xm

        return {"seed": int(xm.get_rng_state(self.device))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state["seed"]), self.device)


def to_cpu(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """``obj`` with every tensor copied to the CPU (nested dicts/lists/tuples); a tensor that appears twice (tied
    weights) becomes one CPU tensor, so the kernel's writer still sees it as tied."""

    from accel.spi import map_tensors

    memo = {} if memo is None else memo

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in memo:
            memo[id(tensor)] = tensor.detach().to("cpu")
        return memo[id(tensor)]

    return map_tensors(copy, obj)


class XLAStrategy(Component):
    """Answers for a run on XLA devices (TPU, or PJRT's CPU/CUDA devices)."""

    role = "strategy"
    provides = frozenset({"distributed", "precision:bf16"})

    def __init__(self, settings: Settings):
        self.settings = settings
        precision = settings.mixed_precision
        if precision not in ("no", "bf16"):
            raise UsageError(
                f"mixed_precision={precision} is not supported on XLA devices by accel-plugin-xla; use bf16 (or no)"
            )
        if settings["downcast_bf16"] and precision != "bf16":
            raise UsageError(
                "downcast_bf16 stores the parameters in bf16 for a bf16 run: it needs --mixed_precision bf16"
            )
        if settings.phase == "launch":
            self.launch = xla_launch.plan(settings)  # checks the launch options now, before anything starts
        self.device: Any = None
        self._optimizers: list[Any] = []  # the optimizers prepared so far (their gradients are reduced at clipping)
        self._reduced: set[int] = set()  # optimizers whose gradients accel_clip_grad_norm already all-reduced

    # ---- launching ----------------------------------------------------------------------------------------

    @hookimpl
    def accel_launch(self, plan: LaunchPlan) -> int:
        return xla_launch.run(self.launch, plan)

    # ---- process start-up ---------------------------------------------------------------------------------

    @hookimpl
    def accel_setup(self, kernel: KernelView) -> None:
        torch_xla = _import_xla()
        self.xm = torch_xla.core.xla_model
        self.xr = torch_xla.runtime
        self.device = torch_xla.device()
        started = int(os.environ.get("WORLD_SIZE") or 0)  # set when torchrun (not torch_xla.launch) started us
        if started > 1 and self.xr.world_size() != started:
            raise UsageError(
                f"{started} processes were started (WORLD_SIZE={started}) but the XLA runtime sees a world "
                f"of {self.xr.world_size()}: they would train separately. Start XLA runs with `accel "
                "launch --plugin xla` (torch_xla.launch); PJRT's CPU runtime runs one process only"
            )

    @hookimpl
    def accel_topology(self, kernel: KernelView) -> Topology:
        xr = self.xr
        return Topology(xr.global_ordinal(), xr.world_size(), xr.local_ordinal(), xr.local_process_count())

    @hookimpl
    def accel_device(self, kernel: KernelView) -> torch.device:
        return self.device

    @hookimpl
    def accel_collectives(self, kernel: KernelView) -> XLACollectives:
        return XLACollectives(kernel.topology.num_processes, self.device)

    @hookimpl
    def accel_autocast(self, kernel: KernelView) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
        if self.settings.mixed_precision != "bf16":
            return None
        import torch

        return functools.partial(torch.autocast, "xla", dtype=torch.bfloat16)

    @hookimpl
    def accel_end_training(self, kernel: KernelView) -> None:
        import torch_xla

        torch_xla.sync(wait=True)
        if kernel.num_processes > 1:
            kernel.collectives.barrier()

    # ---- prepare ------------------------------------------------------------------------------------------

    @hookimpl
    def accel_prepare_training(
        self, kernel: KernelView, models: list[Any], optimizers: list[Any], schedulers: list[Any]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        import torch

        moved: dict[int, torch.nn.Parameter] = {}  # id(CPU parameter) -> its XLA replacement
        for model in models:
            before = list(model.parameters())
            model.to(self.device)
            if self.settings["downcast_bf16"]:
                model.to(torch.bfloat16)
            moved.update((id(old), new) for old, new in zip(before, model.parameters(), strict=True) if old is not new)
        for optimizer in optimizers:
            self._repoint(optimizer, moved)
            self._optimizers.append(optimizer)
        return list(models), list(optimizers), list(schedulers)

    def _repoint(self, optimizer: Any, moved: Mapping[int, Any]) -> None:
        """Make ``optimizer`` update the moved parameters (and move any state it already has)."""
        for group in optimizer.param_groups:
            group["params"] = [moved.get(id(p), p) for p in group["params"]]
        state = {}
        for param, value in optimizer.state.items():
            new = moved.get(id(param), param)
            state[new] = {
                k: v.to(new.device) if hasattr(v, "to") and getattr(v, "ndim", 0) > 0 else v for k, v in value.items()
            }
        optimizer.state.clear()
        optimizer.state.update(state)

    @hookimpl
    def accel_prepare_dataloader(self, kernel: KernelView, dataloader: Any) -> Any:
        from accel.spi import shard_dataloader

        return shard_dataloader(kernel, dataloader, device_loader=self._device_batches)

    def _device_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """One pass of CPU batches, moved to the device ahead of time by torch_xla's MpDeviceLoader (its threads
        are stopped when the pass ends or is abandoned)."""
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        loader = MpDeviceLoader(batches, self.device)
        try:
            it = iter(loader)
            while True:
                with same_rng(self.device):  # the loader syncs before handing out each batch
                    try:
                        batch = next(it)
                    except StopIteration:
                        return
                yield batch
        finally:
            parallel = getattr(loader, "_parallel_loader", None)
            if parallel is not None:
                parallel.close()

    # ---- training step ------------------------------------------------------------------------------------

    @hookimpl
    def accel_clip_grad_norm(
        self, kernel: KernelView, parameters: list[Any], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        import torch

        if kernel.num_processes > 1:  # clip the summed gradients: reduce them now, not again at the step
            for optimizer in self._optimizers:
                if id(optimizer) not in self._reduced:
                    self.xm.reduce_gradients(optimizer)
                    self._reduced.add(id(optimizer))
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    @hookimpl
    def accel_optimizer_step(self, kernel: KernelView, optimizer: Any) -> bool:
        if id(optimizer) in self._reduced:
            self._reduced.discard(id(optimizer))
            optimizer.step()
        else:
            self.xm.optimizer_step(optimizer)
        sync(self.device)  # run the step's graph now (the XLA loader would do it at the next batch)
        return True

    # ---- state --------------------------------------------------------------------------------------------

    @hookimpl
    def accel_model_state_dict(self, kernel: KernelView, model: Any) -> dict[str, Any]:
        sync(self.device)
        return to_cpu(kernel.unwrap_model(model).state_dict())

    @hookimpl
    def accel_state_items(self, kernel: KernelView) -> Mapping[str, Any]:
        return {"xla_rng": XLARandomState(self.device)}

    @staticmethod
    def _claimed(items: Mapping[str, Any]) -> dict[str, str]:
        """Keys this component writes, by kind: optimizers (main process), gradients and xla_rng (each process)."""
        from accel.spi import PreparedOptimizer

        kinds = {key: "optimizer" for key, obj in items.items() if isinstance(obj, PreparedOptimizer)}
        kinds.update({"gradients": "per_process", "xla_rng": "per_process"})
        return kinds

    @hookimpl
    def accel_save_state(
        self, kernel: KernelView, items: Mapping[str, Any], directory: Path
    ) -> Mapping[str, ItemRecord]:
        from accel.spi import write_tree

        sync(self.device)  # one graph run for everything pending, then plain copies to the CPU
        records = {}
        for key, kind in self._claimed(items).items():
            if kind == "per_process":
                stem = f"{key}_rank{kernel.process_index}"
                files = write_tree(directory, stem, to_cpu(items[key].state_dict()))
            elif kernel.is_main_process:  # one copy of what every process holds alike (xm.save's master_only)
                files = write_tree(directory, key, to_cpu(items[key].state_dict()))
            else:
                files = []
            records[key] = ItemRecord(plugin="", format=FORMAT, files=tuple(files), extra={"written_by": kind})
        return records

    @hookimpl
    def accel_load_state(
        self, kernel: KernelView, items: Mapping[str, Any], directory: Path, records: Mapping[str, ItemRecord]
    ) -> list[str]:
        from accel.spi import CheckpointError, read_tree

        stems = {}
        for key, record in records.items():
            per_process = record.extra.get("written_by") == "per_process"
            stems[key] = f"{key}_rank{kernel.process_index}" if per_process else key
            if f"{stems[key]}.json" not in record.files:
                raise CheckpointError(
                    f"checkpoint item {key!r} of {directory} has no {stems[key]}.json (saved by "
                    f"another number of processes?)"
                )
        states = {key: read_tree(directory, stem) for key, stem in stems.items()}
        for key, state in states.items():  # check everything before restoring anything
            obj = items[key]
            if hasattr(obj, "param_groups"):
                saved = [len(g.get("params", ())) for g in state.get("param_groups", [])]
                current = [len(g["params"]) for g in obj.param_groups]
                if saved != current:
                    raise CheckpointError(
                        f"checkpoint item {key!r} does not fit this optimizer: parameters per "
                        f"group {saved} in the checkpoint, {current} in this run"
                    )
        for key, state in states.items():
            items[key].load_state_dict(state)
        return list(states)
