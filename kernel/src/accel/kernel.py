"""The Kernel: one training loop for one process or many, whatever plugins are installed.

Everything backend-specific is asked of the active plugins through the hooks in :mod:`accel.hookspecs`; the
kernel only keeps the bookkeeping every backend shares (gradient accumulation, dataloader state, collectives on
nested structures, the objects it prepared).
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import gc
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from accel.contract import Topology
from accel.data import PreparedDataLoader, skip_first_batches
from accel.dispatch import HotHooks
from accel.errors import UsageError
from accel.options import KERNEL, Settings, did_you_mean, resolve
from accel.plugins import Plugins
from accel.project import ProjectConfiguration, check_project_config, configure_project
from accel.tracking import TrackingMixin, user_stacklevel

#: Keyword arguments of ``Kernel(...)`` that are options of the kernel (plugins may declare more).
_ARGUMENTS = ("mixed_precision", "gradient_accumulation_steps", "cpu", "log_with", "project_dir", "dynamo_backend",
              "plugins")


class GradientState:
    """Shared between the Kernel and its dataloaders: whether this step syncs and where the epoch is."""

    def __init__(self) -> None:
        self.sync_gradients = True
        self.step = 0
        self.active: list[PreparedDataLoader] = []
        #: Whether the innermost dataloader being iterated has handed out its last batch. A plain attribute, kept
        #: up to date by ``enter``/``leave``/``refresh`` (the dataloaders call them), since every step reads it.
        self.end_of_dataloader = False

    def enter(self, loader: PreparedDataLoader) -> None:
        self.active.append(loader)
        self.refresh()

    def leave(self, loader: PreparedDataLoader) -> None:
        if loader in self.active:
            self.active.remove(loader)
        self.refresh()

    def refresh(self) -> None:
        """Read ``end_of_dataloader`` again from the innermost active dataloader (after it changed)."""
        self.end_of_dataloader = bool(self.active) and self.active[-1].end_of_dataloader

    @property
    def remainder(self) -> int:
        return self.active[-1].remainder if self.active else 0


class _Accumulate:
    """The context ``Kernel.accumulate`` returns (a small class: it runs on every training step, where a generator
    based context manager costs several times more)."""

    __slots__ = ("kernel", "models", "stack")

    def __init__(self, kernel: Kernel, models: tuple[torch.nn.Module, ...]):
        self.kernel, self.models, self.stack = kernel, models, None

    def __enter__(self) -> None:
        kernel = self.kernel
        state = kernel.gradient_state
        state.step += 1
        end = state.end_of_dataloader
        state.sync_gradients = end or state.step % kernel._accumulation_steps == 0
        if end:
            state.step = 0
        if not state.sync_gradients and self.models and kernel._hot.no_sync_needed:
            with contextlib.ExitStack() as stack:  # closes what was entered if a later no_sync fails
                for model in self.models:
                    stack.enter_context(kernel.no_sync(model))
                self.stack = stack.pop_all()

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> bool:
        stack = self.stack
        if stack is None:
            return False
        self.stack = None
        return bool(stack.__exit__(kind, value, traceback))


class PreparedOptimizer(torch.optim.Optimizer):
    """Wraps a user optimizer: ``step`` and ``zero_grad`` act only on steps that sync gradients, and go through the
    active plugins (grad scaler, DeepSpeed engine, ...). ``step_was_skipped`` tells whether the last step was
    skipped (inf/NaN gradients)."""

    def __init__(self, kernel: Kernel, optimizer: torch.optim.Optimizer):  # noqa: D107 - no super().__init__ on purpose
        self.optimizer = optimizer
        self.kernel = kernel
        self.step_was_skipped = False

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        kernel = self.kernel
        if not kernel.gradient_state.sync_gradients:
            return
        if kernel._hot.plain_optimizer:  # only the kernel's default answers: its call, made here
            if set_to_none:
                self.optimizer.zero_grad()  # the default: a call without keywords is cheaper on every step
            else:
                self.optimizer.zero_grad(set_to_none=False)
        else:
            kernel._hot.zero_grad(kernel=kernel, optimizer=self.optimizer, set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        kernel = self.kernel
        if not kernel.gradient_state.sync_gradients:
            return
        if closure is not None:
            raise UsageError("optimizer.step(closure) is not supported by prepared optimizers; call the closure first")
        if kernel._hot.plain_optimizer:  # only the kernel's default answers: its call, made here
            self.optimizer.step()
            self.step_was_skipped = False
        else:
            self.step_was_skipped = kernel._hot.optimizer_step(kernel=kernel, optimizer=self.optimizer) is False

    def __repr__(self) -> str:
        return f"Prepared{self.optimizer!r}"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class PreparedScheduler:
    """Wraps an LR scheduler: it steps once per *optimizer* step (not per micro-batch) and not after a skipped
    step, so a schedule means the same with 1 or N processes and any accumulation."""

    def __init__(self, kernel: Kernel, scheduler: Any, optimizers: Sequence[PreparedOptimizer]):
        self.scheduler = scheduler
        self.kernel = kernel
        inner = getattr(scheduler, "optimizer", None)
        self.optimizers = [o for o in optimizers if o.optimizer is inner] or list(optimizers)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.kernel.gradient_state.sync_gradients:
            return
        if any(o.step_was_skipped for o in self.optimizers):
            return
        self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


class AutocastModule(torch.nn.Module):
    """Runs the wrapped module's forward under the precision plugin's autocast and returns float outputs in fp32.
    ``unwrap_model`` returns the user's module without it."""

    def __init__(self, module: torch.nn.Module, context: Callable[[], contextlib.AbstractContextManager[Any]]):
        super().__init__()
        self.module = module
        self._context = context

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._context():
            out = self.module(*args, **kwargs)
        return _to_fp32(out)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, dict):
        return type(obj)({k: _to_fp32(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_fp32(v) for v in obj)
    return obj


def _recursive(fn: Callable[[torch.Tensor], Any]) -> Callable[[Any], Any]:
    """Apply a tensor function over nested lists/tuples/dicts of tensors."""

    def apply(data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return fn(data)
        if isinstance(data, Mapping):
            return type(data)({k: apply(v) for k, v in data.items()})
        if isinstance(data, tuple) and hasattr(data, "_fields"):
            return type(data)(*(apply(v) for v in data))
        if isinstance(data, (list, tuple)):
            return type(data)(apply(v) for v in data)
        raise TypeError(f"expected tensors (or lists/tuples/dicts of tensors), got {type(data).__name__}")

    return apply


class Kernel(TrackingMixin):
    """The training-loop companion. ``Kernel().prepare(model, optimizer, dataloader, scheduler)``, then
    ``kernel.backward(loss)``; the same script runs on one CPU process or many, with any installed plugin.

    Arguments (all optional; ``None`` means "from ``accel launch``/environment/default"):
    ``mixed_precision`` ("no", "fp16", "bf16", "fp8"), ``gradient_accumulation_steps``, ``cpu``, ``log_with``,
    ``project_dir``, ``dynamo_backend``, ``plugins`` (names to select), ``even_batches`` (default True),
    ``extra_plugins`` ((name, module-or-object) pairs registered without entry points, for tests),
    ``project_config`` (:class:`accel.ProjectConfiguration`: checkpoint naming and retention), ``kwargs_handlers``
    (Accelerate's handler objects from :mod:`accel.utils`: their fields set the options plugins declare for them),
    and any option a plugin declares (``Kernel(fsdp_reshard_after_forward=False)``).
    """

    def __init__(
        self,
        *,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool | None = None,
        log_with: str | Sequence[str] | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        dynamo_backend: str | None = None,
        plugins: Sequence[str] | None = None,
        even_batches: bool = True,
        extra_plugins: Iterable[tuple[str, Any]] = (),
        project_config: ProjectConfiguration | None = None,
        kwargs_handlers: Sequence[Any] | None = None,
        **options: Any,
    ) -> None:
        env = dict(os.environ)
        check_project_config(project_config)
        if project_dir is None and project_config is not None:
            project_dir = project_config.project_dir
        self.plugins = Plugins.load(env=env, extra=extra_plugins)
        declared = self.plugins.options()
        for name in options:
            if name not in declared:
                raise TypeError(f"Kernel() got an unexpected argument {name!r}{did_you_mean(name, [o.name for o in declared])}")
        from accel.utils.handlers import route  # Accelerate's kwargs handlers -> the options plugins declare for them

        handled = route(kwargs_handlers or (), declared, options)
        self.profile_handler = handled.profile
        kwargs = {**handled.options, **options}
        for name, value in (("mixed_precision", mixed_precision), ("gradient_accumulation_steps", gradient_accumulation_steps),
                            ("cpu", cpu), ("dynamo_backend", dynamo_backend), ("plugins", plugins),
                            ("project_dir", None if project_dir is None else os.fspath(project_dir)),
                            ("log_with", [log_with] if isinstance(log_with, str) else log_with)):
            if value is not None:
                kwargs[name] = value
        text = env.get("ACCEL_CONFIG") or "{}"
        try:
            if text.startswith("base64:"):  # launchers that re-quote exported values (pdsh, mpirun) carry it encoded
                text = base64.b64decode(text[len("base64:"):], validate=True).decode()
            launched = json.loads(text)
        except ValueError:
            raise UsageError("environment variable ACCEL_CONFIG is not valid JSON; unset it or launch with accel launch") from None
        values, sources = resolve(declared, env=env, launched=launched, kwargs=kwargs)
        world = int(env.get("WORLD_SIZE") or 1)
        self.settings = Settings(values, sources, world_size=world, phase="run", env=env)
        self.even_batches = even_batches
        self._accumulation_steps = int(self.settings["gradient_accumulation_steps"])
        self.project_configuration = configure_project(project_config, self.settings["project_dir"])
        self._custom_objects: list[Any] = []
        self.gradient_state = GradientState()
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._originals: dict[int, torch.nn.Module] = {}  # prepared model -> the user's module
        self._inner: dict[int, torch.nn.Module] = {}  # prepared model -> what the strategy returned
        self._failed: set[Any] = set()  # plugin names (trackers) and (plugin, hook) pairs that raised
        self._warned: set[str] = set()
        self._torn_down = False
        self.plugins.activate(self.settings)
        hook = self.plugins.pm.hook
        hook.accel_setup(kernel=self)
        self.topology: Topology = hook.accel_topology(kernel=self)
        idle = handled.unused(declared, [KERNEL, *(c.name for c in self.plugins.components)])
        if idle and self.is_main_process:
            warnings.warn(idle, UserWarning, stacklevel=user_stacklevel())
        self.device: torch.device = hook.accel_device(kernel=self)
        self.collectives = hook.accel_collectives(kernel=self)
        self._autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = hook.accel_autocast(kernel=self)
        self._hot = HotHooks(self.plugins.pm)  # per-step hooks, resolved once (again at each prepare)
        self._accumulating = _Accumulate(self, ())
        _ACTIVE.append(self)
        atexit.register(self._teardown)

    # ---- settings and topology ----------------------------------------------------------------------------

    @property
    def mixed_precision(self) -> str:
        return self.settings.mixed_precision

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._accumulation_steps

    @property
    def project_dir(self) -> str | None:
        return self.settings["project_dir"]

    @property
    def num_processes(self) -> int:
        return self.topology.num_processes

    @property
    def process_index(self) -> int:
        return self.topology.process_index

    @property
    def local_process_index(self) -> int:
        return self.topology.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.topology.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.topology.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def components(self) -> list[Any]:
        """The active plugin components, in the order hooks ask them."""
        return list(self.plugins.components)

    @property
    def sync_gradients(self) -> bool:
        """Whether the current step synchronises gradients and steps the optimizer (see ``accumulate``)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = bool(value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(o.step_was_skipped for o in self._optimizers)

    def __repr__(self) -> str:
        comps = ", ".join(f"{c.name}:{c.role}" for c in self.plugins.components) or "none"
        return (f"Kernel(process {self.process_index}/{self.num_processes}, device={self.device}, "
                f"mixed_precision={self.mixed_precision}, plugins=[{comps}])")

    # ---- prepare ------------------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: bool = True) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers (any number, any order) for this run; return
        them in the same order (one object returned as itself). Other objects pass through unchanged."""
        from torch.utils.data import DataLoader

        hook = self.plugins.pm.hook
        self._hot = HotHooks(self.plugins.pm)
        kinds: list[str] = []
        models, optimizers, schedulers, dataloaders = [], [], [], []
        for obj in args:
            if self._is_prepared(obj):  # prepared before (by this kernel): returned as it is, never wrapped twice
                kinds.append("other")
            elif isinstance(obj, torch.nn.Module):
                kinds.append("model")
                models.append(obj)
            elif isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, PreparedOptimizer):
                kinds.append("optimizer")
                optimizers.append(obj)
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
                hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")
            ):
                kinds.append("scheduler")
                schedulers.append(obj)
            elif isinstance(obj, DataLoader):
                kinds.append("dataloader")
                dataloaders.append(obj)
            else:
                kinds.append("other")
        for model in models:
            hook.accel_transform_model(kernel=self, model=model)
        w_models, w_opts, w_scheds = hook.accel_prepare_training(
            kernel=self, models=models, optimizers=optimizers, schedulers=schedulers, dataloaders=dataloaders
        )
        if not (len(w_models), len(w_opts), len(w_scheds)) == (len(models), len(optimizers), len(schedulers)):
            raise RuntimeError("accel_prepare_training returned lists of the wrong length")
        for original, inner in zip(models, w_models):
            wrapped = AutocastModule(inner, self._autocast) if self._autocast is not None else inner
            self._originals[id(wrapped)] = original
            self._inner[id(wrapped)] = inner
            self._models.append(wrapped)
        prepared_opts = [PreparedOptimizer(self, o) for o in w_opts]
        self._optimizers.extend(prepared_opts)
        prepared_scheds = [PreparedScheduler(self, s, self._optimizers) for s in w_scheds]
        self._schedulers.extend(prepared_scheds)
        queues = {"model": iter(self._models[len(self._models) - len(models):]), "optimizer": iter(prepared_opts),
                  "scheduler": iter(prepared_scheds)}
        out = []
        for obj, kind in zip(args, kinds):
            if kind == "dataloader":
                loader = hook.accel_prepare_dataloader(kernel=self, dataloader=obj)
                if isinstance(loader, PreparedDataLoader):
                    loader.device_placement = device_placement
                self._dataloaders.append(loader)
                out.append(loader)
            elif kind == "other":
                out.append(obj)
            else:
                out.append(next(queues[kind]))
        return out[0] if len(out) == 1 else tuple(out)

    def _is_prepared(self, obj: Any) -> bool:
        """Whether ``prepare`` returned ``obj`` before (Accelerate returns such objects as they are, too)."""
        return any(obj is known for group in (self._models, self._optimizers, self._schedulers, self._dataloaders)
                   for known in group)

    def model_init_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context to build models in (``with kernel.model_init_context(): model = Net()``): a strategy that
        partitions parameters as they are created (DeepSpeed ZeRO-3 with ``zero3_init_flag``) answers it; with
        every other plugin it does nothing."""
        return self.plugins.pm.hook.accel_model_init_context(kernel=self)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        return self.prepare(optimizer)

    def prepare_data_loader(self, dataloader: Any) -> Any:
        return self.prepare(dataloader)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self.prepare(scheduler)

    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's own module behind a prepared one (no DDP/autocast wrapper, fp32 forward)."""
        original = self._originals.get(id(model), model)
        if not keep_torch_compile and hasattr(original, "_orig_mod"):
            original = original._orig_mod
        return original

    # ---- training step ------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward through the active plugins (scaler, engine, ...). The loss is divided by
        ``gradient_accumulation_steps`` so accumulated gradients average over micro-batches. Keyword arguments
        (``retain_graph=True``, ``inputs=[...]``) go on to ``Tensor.backward``."""
        hot = self._hot
        if hot.plain_backward:  # only the kernel's default answers: its call, made here
            loss = self.scale_for_accumulation(loss)
            if kwargs:
                loss.backward(**kwargs)
            else:
                loss.backward()  # `**{}` would take the interpreter's slower call path on every step
        else:
            hot.backward(kernel=self, loss=loss, backward_kwargs=kwargs)

    def scale_for_accumulation(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss / gradient_accumulation_steps`` (for plugins answering ``accel_backward``)."""
        steps = self._accumulation_steps
        return loss / steps if steps > 1 else loss

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip gradient synchronisation for the backward passes inside (DDP's ``no_sync``)."""
        inner = self._inner.get(id(model), model)
        with self._hot.no_sync(kernel=self, model=inner):
            yield

    def accumulate(self, *models: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """One micro-batch of gradient accumulation: sets ``sync_gradients`` (every
        ``gradient_accumulation_steps``-th step, and on the last batch of an epoch) and skips the gradient
        all-reduce on the other steps. Prepared optimizers and schedulers act only on sync steps."""
        ctx = self._accumulating  # one context per kernel, made again only for other models or while it is in use
        if ctx.stack is None and ctx.models == models:
            return ctx
        ctx = self._accumulating = _Accumulate(self, models)
        return ctx

    def unscale_gradients(self) -> None:
        self._hot.unscale_gradients(kernel=self)

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip by global norm on sync steps and return the norm; on accumulation steps do nothing, return None
        (the local gradients are partial there)."""
        if not self.gradient_state.sync_gradients:
            return None
        self.unscale_gradients()
        return self._hot.clip_grad_norm(
            kernel=self, parameters=list(parameters), max_norm=float(max_norm), norm_type=float(norm_type)
        )

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        if not self.gradient_state.sync_gradients:
            return
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of the active plugins (a no-op without one)."""
        return self._autocast() if self._autocast is not None else contextlib.nullcontext()

    # ---- processes ----------------------------------------------------------------------------------------

    def wait_for_everyone(self) -> None:
        self.collectives.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine (on the local main process)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. downloads), then the others."""
        yield from self._first(self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        yield from self._first(self.is_local_main_process)

    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.wait_for_everyone()
        yield
        if leader:
            self.wait_for_everyone()

    def on_main_process(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``fn`` on the main process only (returns None elsewhere)."""
        return self.on_process(fn, process_index=0)

    def on_local_main_process(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.on_local_process(fn, local_process_index=0)

    def on_last_process(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.on_process(fn, process_index=self.num_processes - 1)

    def on_process(self, fn: Callable[..., Any] | None = None, *, process_index: int = 0) -> Any:
        if fn is None:
            return functools.partial(self.on_process, process_index=process_index)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if self.process_index == process_index else None

        return run

    def on_local_process(self, fn: Callable[..., Any] | None = None, *, local_process_index: int = 0) -> Any:
        if fn is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if self.local_process_index == local_process_index else None

        return run

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this process's contiguous share of a list, tuple, dict of sequences or tensor (the first
        ``len % N`` processes get one more). ``apply_padding`` repeats the last element so all shares are equal."""
        n, r = self.num_processes, self.process_index
        if n == 1:
            yield inputs
            return

        def split(seq: Any) -> Any:
            size, extra = divmod(len(seq), n)
            start = r * size + min(r, extra)
            end = start + size + (1 if r < extra else 0)
            part = seq[start:end]
            if apply_padding and extra and r >= extra:
                pad = seq[-1:]
                part = torch.cat([part, pad]) if isinstance(part, torch.Tensor) else part + type(part)(pad)
            return part

        if isinstance(inputs, Mapping):
            yield type(inputs)({k: split(v) for k, v in inputs.items()})
        else:
            yield split(inputs)

    # ---- collectives on nested data -----------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Gather tensors (or nested structures of them) from all processes and concatenate on dim 0, in process
        order. Works when processes hold different numbers of rows."""
        if self.num_processes == 1:
            return tensor
        return _recursive(self._gather_one)(tensor)

    def _gather_one(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.ndim == 0:
            tensor = tensor[None]
        tensor = tensor.contiguous()
        sizes = [int(s.item()) for s in self.collectives.all_gather(torch.tensor([tensor.shape[0]], device=tensor.device))]
        top = max(sizes)
        if top != tensor.shape[0]:
            pad = tensor.new_zeros((top - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        parts = self.collectives.all_gather(tensor)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)])

    def gather_object(self, obj: Any) -> list[Any]:
        """Gather picklable objects; lists are concatenated, other objects collected in a list."""
        parts = self.collectives.all_gather_object(obj)
        if all(isinstance(p, list) for p in parts):
            return [x for p in parts for x in p]
        return parts

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather`` for evaluation: on the last batch of an epoch, drops the samples that even batching
        duplicated, so the result over an epoch has exactly ``len(dataset)`` items."""
        tensors_only = True
        try:
            _recursive(lambda t: t)(input_data)
        except TypeError:
            tensors_only = False
        data = self.gather_object(input_data) if (use_gather_object or not tensors_only) else self.gather(input_data)
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            if isinstance(data, list) and not tensors_only:
                return data[: state.remainder]
            return _recursive(lambda t: t[: state.remainder])(data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce (``"sum"``, ``"mean"``, ``"max"`` or ``"none"``) tensors of a nested structure, then
        multiply by ``scale``. Returns new tensors; inputs are not modified."""
        if reduction not in ("sum", "mean", "max", "none"):
            raise ValueError(f"reduction must be sum, mean, max or none, got {reduction!r}")

        def one(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            if reduction != "none" and self.num_processes > 1:
                self.collectives.all_reduce(t, "max" if reduction == "max" else "sum")
                if reduction == "mean":
                    t = t / self.num_processes
            return t * scale if scale != 1.0 else t

        return _recursive(one)(tensor)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size over all processes, so they can be gathered."""

        def one(t: torch.Tensor) -> torch.Tensor:
            if self.num_processes == 1 or t.ndim == 0:
                return t
            d = dim % t.ndim
            sizes = self.collectives.all_gather(torch.tensor([t.shape[d]], device=t.device))
            top = max(int(s.item()) for s in sizes)
            if top == t.shape[d]:
                return t
            shape = list(t.shape)
            shape[d] = top - t.shape[d]
            pad = t.new_full(shape, pad_index)
            return torch.cat([pad, t] if pad_first else [t, pad], dim=d)

        return _recursive(one)(tensor)

    def broadcast(self, data: Any, from_process: int = 0) -> Any:
        """Tensors of process ``from_process`` on every process (in place); other objects via pickling."""
        if self.num_processes == 1:
            return data
        try:
            return _recursive(lambda t: self.collectives.broadcast(t.contiguous(), from_process))(data)
        except TypeError:
            return self.collectives.broadcast_object(data, from_process)

    # ---- saving -------------------------------------------------------------------------------------------

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = True) -> None:
        """Save on the main process only: a flat dict of tensors as safetensors, anything else with torch.save."""
        if not self.is_main_process:
            return
        if safe_serialization and isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().cpu() for k, v in obj.items()}, os.fspath(f))
        else:
            torch.save(obj, f)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The full state dict of a prepared model (gathered from shards where a plugin shards it)."""
        return self.plugins.pm.hook.accel_model_state_dict(kernel=self, model=model)

    # ---- checkpoints (accel.checkpoint) -------------------------------------------------------------------

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict``/``load_state_dict`` in ``save_state``/``load_state`` (items
        ``custom_0``, ``custom_1``, ... in registration order)."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise UsageError(f"register_for_checkpointing: {type(obj).__name__} has no state_dict() and "
                                 "load_state_dict(); only such objects can be checkpointed")
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None) -> os.PathLike[str]:
        """Save everything needed to resume exactly: prepared models, optimizers, schedulers and dataloader
        positions, registered objects, plugin items (grad scaler, ...), and every process's random states.
        Call it on every process. Without ``output_dir`` it writes ``project_dir/checkpoints/checkpoint_<i>``
        (see :class:`accel.ProjectConfiguration`). Atomic: the directory appears complete or not at all.
        Returns the checkpoint's directory."""
        from accel import checkpoint  # imported on first use: a run that never saves does not pay for it

        return checkpoint.save_state(self, output_dir)

    def load_state(self, input_dir: str | os.PathLike[str] | None = None) -> os.PathLike[str]:
        """Restore what ``save_state`` saved, after checking that it fits this run (plugins, items, number of
        processes, shapes). Without ``input_dir``: the newest complete checkpoint of the project. Call it on every
        process, after ``prepare``. The next pass over each prepared dataloader continues where the saved one
        stopped. Returns the directory loaded."""
        from accel import checkpoint  # imported on first use: a run that never saves does not pay for it

        return checkpoint.load_state(self, input_dir)

    def latest_checkpoint(self) -> os.PathLike[str] | None:
        """The newest complete checkpoint of the project (as the main process sees it), or None. Call it on every
        process: ``if kernel.latest_checkpoint(): kernel.load_state()``."""
        project = self.project_configuration.project_dir
        from accel import checkpoint  # imported on first use: a run that never saves does not pay for it

        found = checkpoint.latest_checkpoint(project) if (project and self.is_main_process) else None
        found = self.collectives.broadcast_object(None if found is None else os.fspath(found), 0)
        return None if found is None else Path(found)

    @property
    def save_iteration(self) -> int:
        """The number the next automatic checkpoint gets."""
        return self.project_configuration.iteration

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike[str],
                   max_shard_size: int | str = "10GB") -> list[os.PathLike[str]]:
        """Write a prepared model's full weights as safetensors (``model.safetensors``, or shards plus
        ``model.safetensors.index.json`` above ``max_shard_size``); tied weights are stored once. Call it on every
        process; the main process writes. Load with :func:`accel.load_model`."""
        from accel import checkpoint  # imported on first use: a run that never saves does not pay for it

        return list(checkpoint.save_model(self, model, save_directory, max_shard_size))

    def skip_first_batches(self, dataloader: Any, num_batches: int) -> Any:
        """A dataloader whose next pass starts at batch ``num_batches``; skipped batches are not loaded."""
        return skip_first_batches(dataloader, num_batches)

    # ---- memory and teardown ------------------------------------------------------------------------------

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget the prepared objects, collect garbage and empty the device cache. Returns ``[None] * len(objects)``
        so ``model, opt = kernel.free_memory(model, opt)`` drops the caller's references too."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._originals.clear()
        self._inner.clear()
        gc.collect()
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            memory = getattr(accelerator, "memory", None)
            empty = getattr(memory, "empty_cache", None) if memory is not None else None
            if empty is not None:
                empty()
        return [None] * len(objects)

    clear = free_memory

    def call_isolated(self, hook_name: str, *, trackers: bool | None = None, **kwargs: Any) -> None:
        """Call every implementation of a broadcast hook on its own: one that raises is warned about once and
        skipped from then on (a tracker that raises is skipped for every tracking hook; teardown per hook).
        Trackers run on the main process unless they set ``main_process_only = False``. ``trackers=True`` calls
        only tracker components, ``False`` only the others, ``None`` everyone."""
        for impl in reversed(getattr(self.plugins.pm.hook, hook_name).get_hookimpls()):
            tracker = getattr(impl.plugin, "role", None) == "tracker"
            if trackers is not None and tracker != trackers:
                continue
            key: Any = impl.plugin_name if tracker else (impl.plugin_name, hook_name)
            if key in self._failed:
                continue
            if tracker and getattr(impl.plugin, "main_process_only", True) and not self.is_main_process:
                continue
            try:
                impl.function(*[kwargs[a] for a in impl.argnames])
            except Exception as exc:  # logging and teardown must never stop training
                self._failed.add(key)
                who = f"tracker {impl.plugin.name!r}" if tracker else f"plugin {impl.plugin_name!r}"
                warnings.warn(f"{who} failed in {hook_name} and is skipped from now on: "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=user_stacklevel())

    def end_training(self) -> None:
        """Finish trackers and release the processes' resources (process group). Safe to call once at the end."""
        self._end_trackers()
        if not self._torn_down:
            self.call_isolated("accel_end_training", kernel=self, trackers=False)
        self._teardown()

    def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        self._end_trackers()  # a script that never called end_training still gets its logs flushed
        self.call_isolated("accel_teardown", kernel=self)
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    # ---- profiling and triggers (Accelerate's utilities) --------------------------------------------------

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[Any]:
        """``torch.profiler.profile`` built from ``profile_handler`` (an :class:`accel.utils.ProfileKwargs`), else
        the one given in ``kwargs_handlers``, else defaults; yields the profiler (call ``prof.step()`` per step when
        a schedule is set). With ``output_trace_dir`` every process writes ``profile_<process index>.json``
        there at the end, then waits for the others."""
        from accel.utils.handlers import PROFILE_PATTERN_NAME, ProfileKwargs

        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir,
                                                  PROFILE_PATTERN_NAME.format(suffix=self.process_index)))
        self.wait_for_everyone()

    def set_trigger(self) -> None:
        """Raise this process's flag; the next ``check_trigger`` on every process sees it (no barrier needed)."""
        self._trigger = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called ``set_trigger`` since the last check (an all-reduce: call it on every
        process). Resets the flag when it was set."""
        flag = getattr(self, "_trigger", None)
        if flag is None:
            flag = self._trigger = torch.tensor(0, device=self.device)
        if int(self.reduce(flag).item()) >= 1:
            self._trigger = torch.tensor(0, device=self.device)
            return True
        return False


_ACTIVE: list[Kernel] = []


def active_kernel() -> Kernel | None:
    """The most recently created Kernel of this process that has not ended, if any."""
    return _ACTIVE[-1] if _ACTIVE else None
