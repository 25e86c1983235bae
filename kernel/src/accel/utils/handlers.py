"""Accelerate's kwargs handlers (``Kernel(kwargs_handlers=[...])``), with Accelerate's names and fields.

A handler does not configure anything itself: each field it sets (each value that differs from the class
default, as Accelerate's ``to_kwargs``) becomes the value of every option that a plugin declared as taking that
field (``options.add(..., handler="GradScalerKwargs.init_scale")`` in ``accel_add_options``). A field that no
installed plugin takes is an error, never silently dropped. ``ProfileKwargs`` is the kernel's own
(``Kernel.profile``). Handlers of one plugin's options live in that plugin (``accel.utils`` finds them by name).
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from accel.errors import UsageError

if TYPE_CHECKING:
    import torch

    from accel.options import Options


@dataclass
class KwargsHandler:
    """Base class of the handlers: ``to_dict`` and ``to_kwargs`` (the fields that differ from the defaults)."""

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy({f.name: getattr(self, f.name) for f in fields(self)})

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if default[k] != v}


def option_value(value: Any) -> Any:
    """A handler field's value in an option's terms: enums by value, durations in seconds."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, timedelta):
        return value.total_seconds()
    return value


@dataclass
class AutocastKwargs(KwargsHandler):
    """``torch.autocast`` arguments for the forward of prepared models."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """``torch.amp.GradScaler`` arguments (fp16)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """``torch.distributed.init_process_group`` arguments. A ``timeout`` of None is 600 s for the class default
    backend and 1800 s for any other (as Accelerate)."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is None:
            self.timeout = timedelta(seconds=600 if self.backend == "nccl" else 1800)


#: Accelerate's name for the file ``Kernel.profile`` writes per process into ``output_trace_dir``.
PROFILE_PATTERN_NAME = "profile_{suffix}.json"


@dataclass
class ProfileKwargs(KwargsHandler):
    """``torch.profiler.profile`` arguments for ``Kernel.profile()``. ``activities``: names of
    ``torch.profiler.ProfilerActivity`` members ("cpu", "cuda", "xpu", ...); ``schedule_option``: the arguments of
    ``torch.profiler.schedule`` (wait, warmup, active, repeat, skip_first); ``on_trace_ready`` is called in each
    process; ``output_trace_dir``: each process writes ``profile_<process index>.json`` there (Chrome trace)."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity] | None:
        import torch

        if self.activities is None:
            return None
        known = {a.name.lower(): a for a in torch.profiler.supported_activities()}
        out = []
        for name in self.activities:
            if str(name).lower() not in known:
                raise UsageError(
                    f"ProfileKwargs(activities=...): {name!r} is not available here; choose from "
                    f"{', '.join(sorted(known))}"
                )
            out.append(known[str(name).lower()])
        return out

    def build(self) -> torch.profiler.profile:
        import torch

        schedule = None
        if self.schedule_option is not None:
            try:
                schedule = torch.profiler.schedule(**self.schedule_option)
            except TypeError as exc:
                raise UsageError(
                    f"ProfileKwargs(schedule_option=...): {exc}; use wait, warmup, active, repeat and skip_first"
                ) from None
        return torch.profiler.profile(
            activities=self.profiler_activities(),
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


FP8_HINT = (
    "accel sets fp8 through options: Kernel(mixed_precision='fp8', fp8_recipe=..., fp8_pad_inner_dim=...) "
    "and the other fp8_* options of accel-plugin-amp (torchao float8)"
)


class _Refused(KwargsHandler):
    """Accelerate handlers accel does not take: constructing one raises one line saying what to use instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError(f"{type(self).__name__} is not supported: {FP8_HINT}")


class FP8RecipeKwargs(_Refused):
    """Refused: see ``FP8_HINT``."""


class AORecipeKwargs(_Refused):
    """Refused: see ``FP8_HINT``."""


class TERecipeKwargs(_Refused):
    """Refused: see ``FP8_HINT``."""


class MSAMPRecipeKwargs(_Refused):
    """Refused: see ``FP8_HINT``."""


@dataclass
class Routed:
    """What ``route`` makes of a list of handlers."""

    options: dict[str, Any] = field(default_factory=dict)  # option name -> value
    profile: ProfileKwargs | None = None
    given: dict[str, str] = field(default_factory=dict)  # option name -> "Handler(field=...)" that set it

    def unused(self, declared: Options, active: Iterable[str]) -> str | None:
        """One line naming the handler fields whose options belong to installed plugins that are not active in
        this run (so they change nothing here, as with Accelerate's handlers of an unused backend), or None."""
        active = set(active)
        used = {self.given[name] for name in self.options if declared[name].plugin in active}
        idle = sorted(set(self.given.values()) - used)  # a field counts as used when any option it sets is
        if not idle:
            return None
        return f"kwargs_handlers: {', '.join(idle)} change nothing in this run (no active plugin uses them)"


def route(handlers: Iterable[Any], declared: Options, arguments: Mapping[str, Any]) -> Routed:
    """Turn ``Kernel(kwargs_handlers=...)`` into option values. One handler per class (as Accelerate); each field
    set goes to every declared option that takes it; a field no option takes, or that disagrees with a Kernel
    argument naming the same option, is a ``UsageError``."""
    out = Routed()
    seen: set[type] = set()
    takers: dict[str, list[str]] = {}
    for opt in declared:
        for key in opt.handler:
            takers.setdefault(key, []).append(opt.name)
    for handler in handlers:
        kind = type(handler)
        if not isinstance(handler, KwargsHandler):
            raise UsageError(
                f"Kernel(kwargs_handlers=...) takes kwargs-handler objects (accel.utils."
                f"GradScalerKwargs, ...), got {kind.__name__}"
            )
        if kind in seen:
            raise UsageError(f"You can only pass one {kind.__name__} in `kwargs_handlers`.")
        seen.add(kind)
        if isinstance(handler, ProfileKwargs):
            out.profile = handler
            continue
        for name, value in handler.to_kwargs().items():
            key = f"{kind.__name__}.{name}"
            names = takers.get(key)
            if not names:
                raise UsageError(
                    f"{kind.__name__}({name}=...) is not supported: no installed plugin takes that "
                    "field, so it would change nothing; remove it (docs/utilities.md lists the fields "
                    "each plugin takes)"
                )
            for option in names:
                plain = option_value(value)
                if arguments.get(option) is not None and arguments[option] != plain:
                    raise UsageError(
                        f"{kind.__name__}({name}={value!r}) disagrees with Kernel({option}="
                        f"{arguments[option]!r}); give one of them"
                    )
                out.options[option] = plain
                out.given[option] = f"{kind.__name__}({name}=...)"
    return out
