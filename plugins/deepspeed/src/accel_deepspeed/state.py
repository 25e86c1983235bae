"""Weights and checkpoints of DeepSpeed engines (imports torch and deepspeed: loaded only inside a worker).

Every function here is collective: call it on every process, in the same order.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

#: Checkpoint tag used inside each engine's directory (DeepSpeed writes ``<dir>/<tag>/...``).
TAG = "state"
FORMAT = "deepspeed-checkpoint"
#: A frozen ZeRO-3 model (engine without optimizer): its gathered weights, in its own dtype.
FROZEN_FORMAT = "deepspeed-zero3-frozen"
FROZEN_FILE = "weights.safetensors"


def full_state_dict(engine: Any, sixteen_bit: bool) -> dict[str, torch.Tensor]:
    """The whole model's state dict on process 0 (``{}`` elsewhere), on the CPU, loadable without DeepSpeed.

    ZeRO-3 partitions are gathered layer by layer. Parameters are the fp32 master weights the optimizer keeps
    (DeepSpeed's ``zero_to_fp32`` result, gathered in memory; frozen parameters and buffers are cast to fp32) unless
    ``sixteen_bit``: then they are the weights in the training dtype (bf16/fp16 under mixed precision; fp32
    otherwise, where both are the same)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.utils import safe_get_full_fp32_param

    if engine.zero_optimization_partition_weights():
        state = engine._zero3_consolidated_16bit_state_dict() or {}
    else:
        state = {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}
    low_precision = engine.bfloat16_enabled() or engine.fp16_enabled()
    has_masters = engine.optimizer is not None and not isinstance(engine.optimizer, DeepSpeedZeRoOffload)
    if low_precision and has_masters and not sixteen_bit:
        done: dict[int, torch.Tensor | None] = {}
        for name, param in engine.module.named_parameters(remove_duplicate=False):
            if not param.requires_grad:  # frozen parameters have no master copy
                continue
            if id(param) not in done:
                full = safe_get_full_fp32_param(param)  # collective
                done[id(param)] = None if full is None else full.detach().float().cpu()
            if done[id(param)] is not None and name in state:
                state[name] = done[id(param)]
    if low_precision and not sixteen_bit:  # frozen parameters and buffers too: an all-fp32 export
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    return state if dist.get_rank() == 0 else {}


def files_under(root: Path, sub: Path) -> list[str]:
    """Files below ``root/sub``, relative to ``root``, with '/' separators, sorted."""
    out = []
    for folder, _, files in os.walk(root / sub):
        for name in files:
            out.append(Path(os.path.relpath(os.path.join(folder, name), root)).as_posix())
    return sorted(out)


def save(engine: Any, root: Path, sub: str) -> list[str]:
    """Write the engine's checkpoint (module, ZeRO partitions, optimizer states, step counters) to
    ``root/sub/<TAG>/``; returns the files written there by any process on this machine.

    DeepSpeed writes files between its own barriers; a write that fails on one process (a full disk) would leave
    the others waiting in the next barrier. So failed writes are recorded and skipped, DeepSpeed runs to its end,
    and then every process learns whether any failed (:class:`accel.CheckpointError` on all of them)."""
    from accel.spi import CheckpointError

    failures: list[str] = []

    def deferred(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if failures:
                return None
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                failures.append(f"{type(exc).__name__}: {first}")
                return None

        return call

    saver = engine.checkpoint_engine
    patched = [(saver, "save"), (engine, "_copy_recovery_script")]
    for obj, name in patched:
        setattr(obj, name, deferred(getattr(obj, name)))
    try:
        engine.save_checkpoint(os.fspath(root / sub), tag=TAG, save_latest=False)
    finally:
        for obj, name in patched:
            delattr(obj, name)  # the instance attribute shadowed the class's method
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failures[0] if failures else None)
    failed = [(rank, message) for rank, message in enumerate(everyone) if message]
    if failed:
        import shutil

        free = shutil.disk_usage(root).free
        raise CheckpointError(
            f"DeepSpeed could not write its checkpoint into {root / sub} on process "
            f"{failed[0][0]}: {failed[0][1]} ({free} bytes free there)"
        )
    return files_under(root, Path(sub))


def _allowed_globals() -> list[Any]:
    """The only non-tensor classes DeepSpeed's checkpoint files reference (besides what torch's weights-only
    unpickler allows anyway): enums and plain records, no code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Make every ``torch.load`` inside the block weights-only (plus ``_allowed_globals``), whatever its caller
    asks: DeepSpeed loads its files with ``weights_only=False``, and a checkpoint must never run code when loaded.
    A file that needs anything else is refused with :class:`accel.CheckpointError`."""
    from accel.spi import CheckpointError, weights_only_reason

    original = torch.load
    allowed = _allowed_globals()

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return original(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"refusing to load {f}: it holds more than weights ({weights_only_reason(exc)})"
            ) from None
        except Exception as exc:  # damaged or not a torch file: one line, like every checkpoint error
            raise CheckpointError(f"cannot load {f}: {weights_only_reason(exc)}") from None

    torch.load = load  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load = original  # type: ignore[assignment]


def load(engine: Any, root: Path, sub: str, with_optimizer: bool) -> None:
    """Load the engine's checkpoint. First every process opens every file of it weights-only (memory-mapped: the
    tensors are not read) and all learn whether that worked on every process, so a forged or damaged file is
    refused on every process before DeepSpeed's own collectives could leave one of them waiting."""
    from accel.spi import CheckpointError

    problem = None
    try:
        with weights_only_loads():
            for path in sorted((root / sub / TAG).glob("*.pt")):
                torch.load(path, map_location="cpu", mmap=True)
    except CheckpointError as exc:
        problem = str(exc)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    failed = [(rank, message) for rank, message in enumerate(everyone) if message]
    if failed:
        raise CheckpointError(f"{failed[0][1]} (process {failed[0][0]})")
    with weights_only_loads():
        path, _ = engine.load_checkpoint(
            os.fspath(root / sub), tag=TAG, load_optimizer_states=with_optimizer, load_lr_scheduler_states=False
        )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load its checkpoint from {root / sub}")


def save_frozen(engine: Any, root: Path, sub: str) -> list[str]:
    """Write the gathered weights of a frozen ZeRO-3 model (no optimizer: DeepSpeed's checkpoint does not apply) as
    ``root/sub/weights.safetensors``, on process 0."""
    from safetensors.torch import save_file

    from accel.spi import CheckpointError

    state = full_state_dict(engine, sixteen_bit=True)
    problem = None
    if dist.get_rank() == 0:
        try:
            (root / sub).mkdir(parents=True, exist_ok=True)
            save_file({k: v.clone().contiguous() for k, v in state.items()}, os.fspath(root / sub / FROZEN_FILE))
        except Exception as exc:  # a full disk: every process learns it here, none is left in a barrier
            problem = f"cannot write {root / sub / FROZEN_FILE}: {type(exc).__name__}: {exc}".splitlines()[0]
    box = [problem]
    dist.broadcast_object_list(box, 0)
    if box[0]:
        raise CheckpointError(box[0])
    return files_under(root, Path(sub))


def load_frozen(engine: Any, root: Path, sub: str) -> None:
    """Put saved weights back into a frozen ZeRO-3 model, one layer at a time (gathered, written by process 0,
    partitioned again)."""
    import deepspeed
    from safetensors.torch import load_file

    state = load_file(os.fspath(root / sub / FROZEN_FILE))

    def fill(module: torch.nn.Module, prefix: str) -> None:
        params = list(module.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if dist.get_rank() == 0:
                with torch.no_grad():
                    for name, param in module.named_parameters(recurse=False):
                        param.copy_(state[prefix + name])
        with torch.no_grad():
            for name, buf in module.named_buffers(recurse=False):
                if prefix + name in state:
                    buf.copy_(state[prefix + name])
        for name, child in module.named_children():
            fill(child, f"{prefix}{name}.")

    fill(engine.module, "")
