"""Checkpoint items of sharded models and their optimizers.

``SHARDED_STATE_DICT`` (default): each model and each optimizer is one torch.distributed.checkpoint (DCP)
directory named after its item key (``model/``, ``optimizer/``); every rank writes its own shards, and DCP reshards
on load, so a checkpoint saved on N ranks loads on any number of ranks. ``FULL_STATE_DICT``: the main process
gathers everything and writes ``<key>.safetensors`` (models) or ``<key>.pt`` (optimizers, plain containers of
tensors and numbers that ``torch.load(weights_only=True)`` reads); on load the main process reads them and the
tensors are broadcast and sharded. The manifest record says which format was written, so either loads whatever
``fsdp_state_dict_type`` is set to now.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from accel import CheckpointError, ItemRecord, UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from accel import Kernel

PLUGIN = "fsdp"
DCP_FORMAT = "torch.distributed.checkpoint"
FULL_MODEL_FORMAT = "safetensors-full"
FULL_OPTIM_FORMAT = "torch-weights-only-full"


def _options(full: bool, broadcast: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if not full:
        return StateDictOptions()
    if broadcast:
        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    """DCP's save (collective: a failure on any process raises on every process), as one-line CheckpointError."""
    import torch.distributed.checkpoint as dcp

    from accel.checkpoint import error_line  # imports torch: not at module level (`accel plugins` lists the plugin)

    try:
        dcp.save(state, checkpoint_id=path)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise CheckpointError(f"cannot write {path}: {error_line(exc)}") from None


def save_model(kernel: Kernel, model: nn.Module, key: str, directory: Path, full: bool) -> ItemRecord:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from accel.checkpoint import agree  # imports torch: not at module level

    state = get_model_state_dict(model, options=_options(full))  # collective
    if not full:
        _dcp_save(state, directory / key)
        return ItemRecord(plugin=PLUGIN, format=DCP_FORMAT, files=(key,))
    name = f"{key}.safetensors"

    def write() -> None:
        if kernel.is_main_process:
            from safetensors.torch import save_file

            tensors = cast("dict[str, torch.Tensor]", state)  # a full state dict holds plain tensors
            save_file(_unshare(tensors), str(directory / name), metadata={"format": "pt"})

    agree(kernel, f"save_state (writing {name})", write)  # before the next item's collectives
    return ItemRecord(plugin=PLUGIN, format=FULL_MODEL_FORMAT, files=(name,))


def load_model(kernel: Kernel, model: nn.Module, key: str, directory: Path, record: ItemRecord) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from accel.checkpoint import agree, dcp_load  # imports torch: not at module level

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
        set_model_state_dict(model, state, options=_options(True, broadcast=True))
    else:
        raise UsageError(f"checkpoint item {key!r} has format {record.format!r}, which accel-plugin-fsdp does not read")


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


FRESH = "accel_fsdp_fresh"  # saved next to an optimizer's state: it had taken no step yet


def save_optimizer(
    kernel: Kernel, model: nn.Module, optimizer: torch.optim.Optimizer, key: str, directory: Path, full: bool
) -> ItemRecord:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from accel.checkpoint import agree  # imports torch: not at module level (`accel plugins` lists the plugin)

    # torch fills an empty optimizer state with a zero-learning-rate step to learn its layout; undo that, so that
    # saving before the first step changes nothing, and store the fact (loading empties the state again).
    fresh = not optimizer.state
    state: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=_options(full)))
    if fresh:
        optimizer.state.clear()
    state[FRESH] = fresh
    if not full:
        _dcp_save(state, directory / key)
        return ItemRecord(plugin=PLUGIN, format=DCP_FORMAT, files=(key,))
    name = f"{key}.pt"

    def write() -> None:
        if kernel.is_main_process:
            import torch

            torch.save(state, directory / name)

    agree(kernel, f"save_state (writing {name})", write)
    return ItemRecord(plugin=PLUGIN, format=FULL_OPTIM_FORMAT, files=(name,))


def load_optimizer(
    kernel: Kernel, model: nn.Module, optimizer: torch.optim.Optimizer, key: str, directory: Path, record: ItemRecord
) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from accel.checkpoint import agree, dcp_load  # imports torch: not at module level

    if record.format == DCP_FORMAT:
        state: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer))
        state[FRESH] = False
        dcp_load(state, directory / key)
        fresh = bool(state.pop(FRESH))
        set_optimizer_state_dict(model, optimizer, state)
    elif record.format == FULL_OPTIM_FORMAT:
        from accel.checkpoint import load_weights_only

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
        set_optimizer_state_dict(model, optimizer, state, options=_options(True, broadcast=True))
        fresh = bool(kernel.collectives.broadcast_object(fresh, 0))
    else:
        raise UsageError(f"checkpoint item {key!r} has format {record.format!r}, which accel-plugin-fsdp does not read")
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


def detect_record(directory: Path, key: str) -> ItemRecord | None:
    """The record of an item from the files alone (for ``load_sharded``, which does not read the manifest)."""
    if (directory / key / ".metadata").is_file():
        return ItemRecord(plugin=PLUGIN, format=DCP_FORMAT, files=(key,))
    if (directory / f"{key}.safetensors").is_file():
        return ItemRecord(plugin=PLUGIN, format=FULL_MODEL_FORMAT, files=(f"{key}.safetensors",))
    if (directory / f"{key}.pt").is_file():
        return ItemRecord(plugin=PLUGIN, format=FULL_OPTIM_FORMAT, files=(f"{key}.pt",))
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


def SafeReader(path: Path) -> Any:  # noqa: N802 - the kernel's class, built on first use (imports torch)
    """A DCP storage reader that never runs code from the files (see :func:`accel.checkpoint.dcp_load`)."""
    from accel.checkpoint import dcp_reader

    return dcp_reader(path)
