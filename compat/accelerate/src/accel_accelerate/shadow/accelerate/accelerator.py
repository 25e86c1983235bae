"""``accelerate.Accelerator`` on accel: an ``accel.Kernel`` that takes Accelerate's constructor arguments (the
plugin objects become the options of accel's plugins) and has the members libraries built on Accelerate use
(transformers' ``Trainer``, TRL, PEFT, diffusers' training scripts)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import types
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from accel import Kernel
from accel.data_arguments import DataLoaderConfiguration, GradientAccumulationPlugin
from accel.errors import UsageError
from accel.nested import map_tensors
from accel.prepared import AutocastModule, PreparedOptimizer
from accel.project import ProjectConfiguration
from accelerate.state import QUIET, AcceleratorState, GradientState, PartialState
from accelerate.utils.dataclasses import (
    DeepSpeedPlugin,
    DistributedType,
    FullyShardedDataParallelPlugin,
    TorchDynamoPlugin,
)

logger = logging.getLogger(__name__)

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
        if "ACCEL_SEED_SAMPLERS" not in os.environ:  # one process: a shuffling order from torch's generator
            options.setdefault("seed_samplers", False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=QUIET)
            super().__init__(**arguments, **options)
        self.gradient_state = GradientState(plugin)
        self.__dict__["_accelerate_dataloader_config"] = arguments.get("dataloader_config")
        self._accelerate_plugins = given
        self._deepspeed_steps: list[PreparedOptimizer] = []  # the Kernel's optimizers of DeepSpeed engines
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

    @property  # type: ignore[override]
    def dataloader_config(self) -> DataLoaderConfiguration:
        """The ``DataLoaderConfiguration`` given, else the run's with Accelerate's defaults (no seedable sampler, not
        stateful: ``load_state`` restarts the epoch and the script skips the batches it saw, as diffusers' do)."""
        config = self.__dict__.get("_accelerate_dataloader_config")
        if config is None:
            base = super().dataloader_config
            config = dataclasses.replace(base, use_seedable_sampler=False, use_stateful_dataloader=False)
        return config

    @dataloader_config.setter
    def dataloader_config(self, value: DataLoaderConfiguration) -> None:
        Kernel.dataloader_config.fset(self, value)
        self.__dict__["_accelerate_dataloader_config"] = value

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:  # type: ignore[override]
        """Accelerate's ``prepare``: a DataLoader's sampler follows Accelerate's rules (``use_seedable_sampler``:
        a ``SeedableRandomSampler`` seeded from ``data_seed``, else ``torch.random.initial_seed()``, as
        ``set_seed`` left it; without it a generator of the sampler's own), and the prepared loader is a
        ``DataLoaderShard``, so the batches and the objects a script inspects are Accelerate's."""
        if "_kernel" not in AcceleratorState._shared_state:
            raise AttributeError(
                "`AcceleratorState` object has no attribute `distributed_type`. This happens if "
                "`AcceleratorState._reset_state()` was called and an `Accelerator` or `PartialState` was not "
                "reinitialized."
            )
        from accelerate.data_loader import accelerate_sampler, as_accelerate_loader

        config = self.dataloader_config
        for obj in args:
            if isinstance(obj, torch.utils.data.DataLoader) and not self._is_prepared(obj):
                accelerate_sampler(obj, config.use_seedable_sampler, config.data_seed, self)
        if self.deepspeed_plugin is not None:
            self._adopt_deepspeed_config(self.deepspeed_plugin)
        out = self._deepspeed_optimizers(super().prepare(*args))  # DeepSpeedOptimizerWrapper: see backward()
        for obj in out if len(args) > 1 else (out,):
            if isinstance(obj, AutocastModule):  # the unwrapped model computes in the autocast too, as in Accelerate
                self._autocast_forward(self.unwrap_model(obj))
        if len(args) == 1:
            return as_accelerate_loader(out, config.use_stateful_dataloader)
        return tuple(as_accelerate_loader(obj, config.use_stateful_dataloader) for obj in out)

    def prepare_data_loader(
        self, data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None
    ) -> Any:  # type: ignore[override]
        return self.prepare(data_loader)

    def prepare_model(  # type: ignore[override]
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        if evaluation_mode:  # Accelerate wraps nothing for evaluation (TRL's reference models): placed, autocast
            if device_placement is not False:
                model = model.to(self.device)
            self._autocast_forward(model)
            return model
        return super().prepare_model(model)

    def _autocast_forward(self, model: torch.nn.Module) -> None:
        """Accelerate's mixed precision: the module's own ``forward`` runs under the autocast and returns fp32
        outputs (the original kept as ``_original_forward``), so calls of the unwrapped model (the Trainer's
        ``self.model``: TRL's reference forwards with the adapter disabled, its generation) compute as under
        Accelerate. Under DeepSpeed, as in Accelerate, the engine casts instead."""
        context = self._autocast
        if context is None or "_original_forward" in model.__dict__ or self.deepspeed_plugin is not None:
            return
        forward = model.forward
        function = getattr(forward, "__func__", None)  # a bound method: patched on the function, as Accelerate
        # does, so a deep copy of the model calls its own forward

        def fp32(out: Any) -> Any:
            return map_tensors(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, out)

        if function is None:

            def patched(*args: Any, **kwargs: Any) -> Any:
                with context():
                    return fp32(forward(*args, **kwargs))

            model.forward = functools.wraps(forward)(patched)  # type: ignore[method-assign]
        else:

            def method(module: Any, *args: Any, **kwargs: Any) -> Any:
                with context():
                    return fp32(function(module, *args, **kwargs))

            model.forward = types.MethodType(functools.wraps(function)(method), model)  # type: ignore[method-assign]
        model.__dict__["_original_forward"] = forward

    # ---- DeepSpeed, driven as Accelerate drives it --------------------------------------------------------

    def _adopt_deepspeed_config(self, plugin: DeepSpeedPlugin) -> None:
        """Before a ``prepare``: the DeepSpeed configuration as the library left it goes to the engine, and its
        ``gradient_accumulation_steps`` becomes this Accelerator's where they differ (Accelerate's rule: the
        ``Trainer`` accumulates itself and builds its Accelerator with 1, its DeepSpeed config says its own
        number of steps)."""
        plugin.write_config()
        steps = plugin.deepspeed_config.get("gradient_accumulation_steps")
        if isinstance(steps, int) and not isinstance(steps, bool) and steps != self.gradient_accumulation_steps:
            logger.warning(
                "Gradient accumulation steps mismatch: GradientAccumulationPlugin has %s, DeepSpeed config has %s. "
                "Using DeepSpeed's value.",
                self.gradient_accumulation_steps,
                steps,
            )
            self.gradient_accumulation_steps = steps

    def _deepspeed_optimizers(self, prepared: Any) -> Any:
        """``prepare``'s result with the optimizer of each DeepSpeed engine as a ``DeepSpeedOptimizerWrapper``."""
        engines = self._deepspeed_engines()
        if not engines:
            return prepared
        from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

        stepped = {id(engine.basic_optimizer) for engine in engines if engine.optimizer is not None}

        def swap(obj: Any) -> Any:
            if isinstance(obj, PreparedOptimizer) and id(obj.optimizer) in stepped:
                if obj not in self._deepspeed_steps:
                    self._deepspeed_steps.append(obj)
                return DeepSpeedOptimizerWrapper(obj)
            return obj

        return tuple(swap(obj) for obj in prepared) if isinstance(prepared, tuple) else swap(prepared)

    def _deepspeed_engines(self) -> list[Any]:
        """The engines of the prepared models (accel-plugin-deepspeed's prepared model has the engine as ``engine``)."""
        engines = (getattr(self._inner.get(id(model), model), "engine", None) for model in self._models)
        return [engine for engine in engines if engine is not None and hasattr(engine, "basic_optimizer")]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's ``backward``. Under DeepSpeed it is Accelerate's too: the engine's backward (``scale_wrt_gas``
        and the rest go to it), then, at the end of an accumulation cycle, the engine's step (clipping by the
        configuration's ``gradient_clipping``, the optimizer step, clearing the gradients), so the prepared
        optimizer's ``step``/``zero_grad`` do nothing and ``clip_grad_norm_`` returns the norm of that step."""
        super().backward(loss, **kwargs)
        if self._deepspeed_steps and self.sync_gradients:
            for optimizer in self._deepspeed_steps:
                optimizer.step()

    def clip_grad_norm_(  # type: ignore[override]
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> Any:
        """Accelerate's. Under DeepSpeed the engine clipped in the step ``backward`` ran (by ``gradient_clipping``
        of its configuration, as in Accelerate): the global gradient norm of that step, a float."""
        if not self._deepspeed_steps:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        engine = next((e for e in self._deepspeed_engines() if e.optimizer is not None), None)
        norm = engine.get_global_grad_norm() if engine is not None else None
        return float(norm) if norm is not None else None

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
    def join_uneven_inputs(  # type: ignore[override]
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> Iterator[None]:
        """Accelerate's: torch's ``Join`` over uneven inputs, and for a distributed type Accelerate does not join
        (FSDP, DeepSpeed, XLA, Megatron-LM) its warning and nothing else. Unlike Accelerate's, it also joins on
        several CPU processes (gloo), where Accelerate only warns and a DDP loop over uneven batches hangs."""
        kind = self.distributed_type
        if kind != DistributedType.NO and not str(getattr(kind, "value", kind)).startswith("MULTI_"):
            warnings.warn(
                "Joining uneven inputs is only supported for multi-GPU training, as a result `join_uneven_inputs` "
                "will have no effect.",
                stacklevel=3,
            )
            yield
            return
        with super().join_uneven_inputs(joinables, even_batches):
            yield

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
