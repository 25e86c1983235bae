"""``accelerate.utils.fsdp_utils``: Accelerate's functions that save and load FSDP models piece by piece. Under
accel, FSDP checkpoints are written by the Accelerator's ``save_state``/``load_state`` (torch.distributed.checkpoint,
accel-plugin-fsdp) and ``get_state_dict``; these names exist so libraries import, and say so when called."""

from __future__ import annotations

from typing import Any

import torch

from accel.errors import UsageError


def _refuse(name: str, instead: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UsageError(f"accelerate.utils.{name} is not provided by accel-accelerate: {instead}")

    refuse.__name__ = name
    return refuse


_STATE = "use accelerator.save_state(dir) / accelerator.load_state(dir), which shard FSDP checkpoints themselves"
save_fsdp_model = _refuse("save_fsdp_model", _STATE)
load_fsdp_model = _refuse("load_fsdp_model", _STATE)
save_fsdp_optimizer = _refuse("save_fsdp_optimizer", _STATE)
load_fsdp_optimizer = _refuse("load_fsdp_optimizer", _STATE)
merge_fsdp_weights = _refuse("merge_fsdp_weights", "use accelerator.get_state_dict(model) for the full weights")


def enable_fsdp_ram_efficient_loading() -> None:
    """Accelerate sets an environment variable for transformers; accel-plugin-fsdp loads on rank 0 by its option."""


def disable_fsdp_ram_efficient_loading() -> None:
    """See :func:`enable_fsdp_ram_efficient_loading`."""


def get_fsdp2_grad_scaler(**kwargs: Any) -> Any:
    import torch

    return torch.amp.GradScaler(**kwargs)


def get_parameters_from_modules(modules: Any, model: torch.nn.Module, device: Any = None) -> set[torch.nn.Parameter]:
    """The parameters of the submodules of ``model`` named (or given) in ``modules``."""
    if modules is None:
        return set()
    if isinstance(modules, str):
        modules = [modules]
    found: set[torch.nn.Parameter] = set()
    for entry in modules:
        if isinstance(entry, str):
            import re

            chosen = [m for name, m in model.named_modules() if re.fullmatch(entry, name)]
        else:
            chosen = [entry]
        for module in chosen:
            found.update(module.parameters())
    return found
