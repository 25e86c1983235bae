"""``accelerate.Accelerator`` on accel: an ``accel.Kernel`` that takes Accelerate's constructor arguments (the
plugin objects become the options of accel's plugins) and has the members libraries built on Accelerate use
(transformers' ``Trainer``, TRL, PEFT, diffusers' training scripts)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from accel import Kernel
from accel.data_arguments import DataLoaderConfiguration, GradientAccumulationPlugin
from accel.errors import UsageError
from accel.project import ProjectConfiguration
from accelerate.state import QUIET, AcceleratorState, GradientState, PartialState
from accelerate.utils.dataclasses import (
    DeepSpeedPlugin,
    DistributedType,
    FullyShardedDataParallelPlugin,
    TorchDynamoPlugin,
)

#: Accelerate arguments that name a plugin object; None (what libraries pass when unused) is dropped
_PLUGIN_ARGUMENTS = (
    "deepspeed_plugin",
    "deepspeed_plugins",
    "fsdp_plugin",
    "dynamo_plugin",
    "torch_tp_plugin",
    "megatron_lm_plugin",
    "parallelism_config",
)


def plugin_options(arguments: dict[str, Any]) -> dict[str, Any]:
    """The ``Kernel(...)`` arguments for Accelerate's plugin objects in ``arguments`` (removed from it)."""
    options: dict[str, Any] = {}
    selected: list[str] = []
    deepspeed = arguments.pop("deepspeed_plugin", None)
    several = arguments.pop("deepspeed_plugins", None)
    if several is not None:
        if isinstance(several, dict) and len(several) == 1:
            deepspeed = next(iter(several.values()))
        else:
            raise UsageError(
                "accel runs one DeepSpeed configuration per run: pass deepspeed_plugin=DeepSpeedPlugin(...)"
            )
    if deepspeed is not None:
        selected.append("deepspeed")
        options.update(DeepSpeedPlugin.options_of(deepspeed))
    fsdp = arguments.pop("fsdp_plugin", None)
    if fsdp is not None:
        selected.append("fsdp")
        options.update(FullyShardedDataParallelPlugin.options_of(fsdp))
    dynamo = arguments.pop("dynamo_plugin", None)
    if dynamo is not None:
        options.update(TorchDynamoPlugin.options_of(dynamo))
    for name in ("torch_tp_plugin", "megatron_lm_plugin", "parallelism_config"):
        value = arguments.pop(name, None)
        if value is not None:
            options[name] = value  # the Kernel takes parallelism_config with accel-plugin-parallel, refuses the rest
    if selected:
        options["plugins"] = [*(arguments.pop("plugins", None) or ()), *selected]
    return options


class Accelerator(Kernel):
    """Accelerate's ``Accelerator``: an ``accel.Kernel`` built from Accelerate's arguments."""

    def __init__(self, *args: Any, **arguments: Any) -> None:
        if args:
            arguments = {**dict(zip(_POSITIONAL, args, strict=False)), **arguments}
        given = {name: arguments.get(name) for name in _PLUGIN_ARGUMENTS}  # Accelerate's objects, as passed
        options = plugin_options(arguments)
        plugin = arguments.get("gradient_accumulation_plugin")
        for name in ("mixed_precision", "dynamo_backend"):
            value = arguments.get(name)
            if value is not None and not isinstance(value, str):  # Accelerate's enums are str subclasses
                arguments[name] = str(getattr(value, "value", value))
        if str(arguments.get("dynamo_backend") or "").lower() == "no":
            arguments.pop("dynamo_backend")
        if "ACCEL_SCRIPT_SKIPS_BATCHES" not in os.environ:  # Accelerate's scripts skip a resumed epoch themselves
            options.setdefault("script_skips_batches", True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=QUIET)
            super().__init__(**arguments, **options)
        self.gradient_state = GradientState(plugin)
        self._accelerate_plugins = given
        AcceleratorState._shared_state.clear()
        PartialState._shared_state["_kernel"] = self
        AcceleratorState._shared_state["_kernel"] = self

    # ---- Accelerate's members accel names differently ----------------------------------------------------

    @property  # type: ignore[override]
    def state(self) -> AcceleratorState:
        return AcceleratorState()

    @state.setter
    def state(self, value: Any) -> None:
        pass  # Accelerate's is a plain attribute; its state is this Accelerator's in any case

    @property
    def distributed_type(self) -> Any:
        return DistributedType(self.state.distributed_type)

    @property
    def deepspeed_plugin(self) -> Any:
        """The ``DeepSpeedPlugin`` given (transformers reads its ``hf_ds_config``), else the settings of the
        deepspeed plugin selected otherwise (``accel launch --plugin deepspeed``), or None."""
        if "deepspeed" not in self._component_names():
            return None
        return self._accelerate_plugins.get("deepspeed_plugin") or DeepSpeedPlugin.of_kernel(self)

    @property
    def fsdp_plugin(self) -> Any:
        if "fsdp" not in self._component_names():
            return None
        return self._accelerate_plugins.get("fsdp_plugin") or FullyShardedDataParallelPlugin.of_kernel(self)

    @property
    def is_fsdp2(self) -> bool:
        return self.fsdp_plugin is not None

    @property
    def parallelism_config(self) -> Any:
        return self._accelerate_plugins.get("parallelism_config")

    @property
    def torch_device_mesh(self) -> Any:
        return None

    @property
    def megatron_lm_plugin(self) -> Any:
        return None

    @property
    def torch_tp_plugin(self) -> Any:
        return None

    @property
    def scaler(self) -> Any:
        """The fp16 gradient scaler, or None (bf16, fp32 and engines that scale themselves)."""
        for component in self.components:
            found = getattr(component, "scaler", None)
            if found is not None:
                return found
        return None

    def _component_names(self) -> set[str]:
        return {component.name for component in self.components}

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:  # type: ignore[override]
        """Accelerate's ``prepare``. A shuffling DataLoader's order is drawn from ``data_seed``, else from
        ``torch.random.initial_seed()`` (Accelerate's ``SeedableRandomSampler``: the seed of the script's
        ``set_seed``), so the batches are Accelerate's."""
        config = self.dataloader_config
        if config.data_seed is not None or not any(isinstance(a, torch.utils.data.DataLoader) for a in args):
            return super().prepare(*args)
        self.dataloader_config = dataclasses.replace(config, data_seed=torch.random.initial_seed() % 2**63)
        try:
            return super().prepare(*args)
        finally:
            self.dataloader_config = config

    def prepare_data_loader(
        self, data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None
    ) -> Any:  # type: ignore[override]
        return self.prepare(data_loader)

    def prepare_model(  # type: ignore[override]
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        if evaluation_mode and self.num_processes == 1:
            return model.to(self.device)  # Accelerate wraps nothing for evaluation on one process
        return super().prepare_model(model)

    def gather(self, tensor: Any) -> Any:
        """Accelerate's ``gather``: every process's tensors have the same shape (``pad_across_processes`` first where
        they do not), so one all-gather per tensor does (accel's ``Kernel.gather`` first exchanges the sizes, which
        the Trainer would pay at every step). In debug mode it is accel's gather, which exchanges the sizes first."""
        if self.num_processes == 1 or self.debug:
            return super().gather(tensor)
        from accelerate.utils.operations import recursively_apply

        def one(t: torch.Tensor) -> torch.Tensor:
            parts = self.collectives.all_gather((t[None] if t.ndim == 0 else t).contiguous())
            return torch.cat(parts)

        return recursively_apply(one, tensor, error_on_other_type=True)

    @contextlib.contextmanager
    def maybe_context_parallel(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        yield  # context parallelism is configured through parallelism_config; without it there is nothing to do


_POSITIONAL: Sequence[str] = (
    "device_placement",
    "split_batches",
    "mixed_precision",
    "gradient_accumulation_steps",
    "cpu",
    "dataloader_config",
    "deepspeed_plugin",
    "fsdp_plugin",
    "torch_tp_plugin",
    "megatron_lm_plugin",
    "rng_types",
    "log_with",
    "project_dir",
    "project_config",
    "gradient_accumulation_plugin",
    "step_scheduler_with_optimizer",
    "kwargs_handlers",
    "dynamo_backend",
    "dynamo_plugin",
    "deepspeed_plugins",
    "parallelism_config",
)

__all__ = [
    "Accelerator",
    "AcceleratorState",
    "DataLoaderConfiguration",
    "GradientAccumulationPlugin",
    "GradientState",
    "PartialState",
    "ProjectConfiguration",
]
