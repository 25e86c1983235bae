"""``accelerate.utils.fsdp_utils``: saving and loading FSDP models and optimizers piece by piece, as transformers'
``Trainer`` does in its own checkpoints. accel-plugin-fsdp shards with FSDP2 (``fully_shard``), so these use
torch's distributed state-dict API (``torch.distributed.checkpoint.state_dict``) and ``torch.distributed.checkpoint``
with Accelerate's file names: ``FULL_STATE_DICT`` gathers the whole state onto process 0, which writes
``pytorch_model_fsdp.bin`` / ``optimizer.bin``; ``SHARDED_STATE_DICT`` has every process write its shards into
``pytorch_model_fsdp_<i>/`` / ``optimizer_<i>/``. ``adapter_only`` is accepted and saves the whole model (a PEFT
model's base weights too: larger files, the same resume). ``merge_fsdp_weights`` is not provided."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from accel.errors import UsageError

FSDP_MODEL_NAME = "pytorch_model_fsdp"
OPTIMIZER_NAME = "optimizer"


def _full(fsdp_plugin: Any) -> bool:
    kind = str(
        getattr(getattr(fsdp_plugin, "state_dict_type", None), "name", getattr(fsdp_plugin, "state_dict_type", ""))
    )
    return "SHARDED" not in kind.upper()


def _options(full: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def _name(stem: str, index: int, suffix: str = "") -> str:
    return (stem if index == 0 else f"{stem}_{index}") + suffix


def _save(state: Any, key: str, stem: str, index: int, output_dir: str, full: bool, process_index: int) -> None:
    """``FULL_STATE_DICT``: process 0 writes ``state`` (gathered) to ``<stem>[_i].bin``; sharded: every process
    writes its shards into ``<stem>_<i>/`` under ``key``."""
    os.makedirs(output_dir, exist_ok=True)
    if full:
        if process_index == 0:
            torch.save(state, os.path.join(output_dir, _name(stem, index, ".bin")))
        return
    import torch.distributed.checkpoint as dcp

    dcp.save({key: state}, checkpoint_id=os.path.join(output_dir, f"{stem}_{index}"))


def _load(empty: Any, key: str, stem: str, index: int, input_dir: str, full: bool) -> Any:
    """What :func:`_save` wrote; ``empty``: this process's state to fill (sharded checkpoints)."""
    if full:
        return torch.load(os.path.join(input_dir, _name(stem, index, ".bin")), map_location="cpu", weights_only=True)
    import torch.distributed.checkpoint as dcp

    path = input_dir if f"{stem}_" in os.path.basename(input_dir) else os.path.join(input_dir, f"{stem}_{index}")
    state = {key: empty}
    dcp.load(state, checkpoint_id=path)
    return state[key]


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: torch.nn.Module,
    output_dir: str,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Write ``model``'s state into ``output_dir`` (call it on every process)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = _full(fsdp_plugin)
    state = get_model_state_dict(model, options=_options(full))  # the whole model, a PEFT adapter's base included
    _save(state, "model", FSDP_MODEL_NAME, model_index, output_dir, full, accelerator.process_index)


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: torch.nn.Module,
    input_dir: str,
    model_index: int = 0,
    adapter_only: bool = False,
) -> None:
    """Read what :func:`save_fsdp_model` wrote into ``model`` (call it on every process)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    full = _full(fsdp_plugin)
    empty = None if full else get_model_state_dict(model, options=_options(False))
    state = _load(empty, "model", FSDP_MODEL_NAME, model_index, input_dir, full)
    set_model_state_dict(model, state, options=_options(full))


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: torch.nn.Module,
    output_dir: str,
    optimizer_index: int = 0,
) -> None:
    """Write the optimizer's state into ``output_dir`` (call it on every process)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    full = _full(fsdp_plugin)
    state = get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=_options(full))
    _save(state, "optimizer", OPTIMIZER_NAME, optimizer_index, output_dir, full, accelerator.process_index)


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: torch.nn.Module,
    input_dir: str,
    optimizer_index: int = 0,
    adapter_only: bool = False,
) -> None:
    """Read what :func:`save_fsdp_optimizer` wrote into ``optimizer`` (call it on every process)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    full = _full(fsdp_plugin)
    inner = getattr(optimizer, "optimizer", optimizer)
    empty = None if full else get_optimizer_state_dict(model, inner, options=_options(False))
    state = _load(empty, "optimizer", OPTIMIZER_NAME, optimizer_index, input_dir, full)
    set_optimizer_state_dict(model, inner, state, options=_options(full))


def merge_fsdp_weights(*args: Any, **kwargs: Any) -> None:
    raise UsageError(
        "accelerate.utils.merge_fsdp_weights is not provided by accel-accelerate: save with "
        "fsdp_state_dict_type FULL_STATE_DICT, or read the full weights with accelerator.get_state_dict(model)"
    )


def enable_fsdp_ram_efficient_loading() -> None:
    """Accelerate sets an environment variable for transformers; accel-plugin-fsdp loads on rank 0 by its option."""


def disable_fsdp_ram_efficient_loading() -> None:
    """See :func:`enable_fsdp_ram_efficient_loading`."""


def get_fsdp2_grad_scaler(**kwargs: Any) -> Any:
    return torch.amp.GradScaler(**kwargs)


def get_parameters_from_modules(modules: Any, model: torch.nn.Module, device: Any = None) -> set[torch.nn.Parameter]:
    """The parameters of the submodules of ``model`` named (by regular expression) or given in ``modules``."""
    if modules is None:
        return set()
    if isinstance(modules, str):
        modules = [modules]
    found: set[torch.nn.Parameter] = set()
    for entry in modules:
        chosen = (
            [m for name, m in model.named_modules() if re.fullmatch(entry, name)] if isinstance(entry, str) else [entry]
        )
        for module in chosen:
            found.update(module.parameters())
    return found
