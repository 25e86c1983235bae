"""Experiment tracking: the Kernel's tracker API (its part :class:`Tracking`) and the base class of tracker components. No torch import.

A tracker is a plugin whose ``accel_activate`` returns a :class:`Tracker` when its name is in ``log_with`` (or
``"all"`` is). The Kernel never names a tracker: it calls the tracking hooks of :mod:`accel.hookspecs` on every
active tracker, each isolated, so that a tracker that raises (bad credentials, server gone) is warned about once
and skipped from then on, and training goes on.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from accel.contract import Component
from accel.errors import UsageError, user_stacklevel

if TYPE_CHECKING:
    from accel.options import Settings
    from accel.plugins import Plugins

#: The ``log_with`` entry that asks for every installed tracker.
ALL = "all"


class Tracker(Component):
    """Base class of tracker components (role ``"tracker"``; any number may be active at once).

    Subclasses set ``provides = frozenset({"tracker:<name>"})`` and answer ``accel_init_trackers``, ``accel_log``
    and ``accel_end_training`` (and ``accel_log_images`` / ``accel_log_table`` if the backend can show them) with
    ``@accel.hookimpl`` methods.

    - ``run``: the tracking library's own run or writer object
      once ``accel_init_trackers`` started it, else ``None``; ``kernel.get_tracker(name, unwrap=True)`` returns it.
    - ``main_process_only``: the Kernel calls the tracking hooks of this component on the main process only
      (default). Set it to ``False`` to be called on every process.
    - a public attribute the component does not have is the run object's, once there is one:
      ``kernel.get_tracker("tensorboard").add_images(...)`` works as with Accelerate before 0.17, whose
      ``get_tracker`` returned the writer itself (diffusers' training scripts call it so when the installed
      ``accelerate`` is older than 0.17, or absent, as under accel).
    """

    role = "tracker"
    main_process_only: bool = True
    run: Any = None

    def __getattr__(self, name: str) -> Any:
        run = self.__dict__.get("run")
        if name.startswith("_") or run is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(run, name)


def _requested(settings: Settings, name: str) -> bool:
    """Whether the tracker ``name`` should take part: its name or ``"all"`` is in ``log_with``."""
    wanted = settings.get("log_with") or []
    return name in wanted or ALL in wanted


def check_tracker_names(log_with: Iterable[Any], installed: Iterable[str]) -> None:
    """A ``log_with`` name that is neither an installed plugin nor a published tracker is a UsageError with the
    closest tracker name (``tensorbaord`` -> ``tensorboard``); a published tracker that is not installed is left to
    the capability check, which says what to install."""
    from accel.options import did_you_mean, known_plugins

    published = [n for n, info in known_plugins()["plugins"].items() if f"tracker:{n}" in info["provides"]]
    known = set(installed) | set(published) | {ALL}
    for name in log_with:
        if isinstance(name, str) and name not in known:
            trackers = ", ".join(sorted(set(published) | {ALL}))
            raise UsageError(
                f"log_with={name!r} names no tracker{did_you_mean(name, sorted(known))} (trackers: {trackers}; a "
                "tracker plugin of your own is named as its entry point)"
            )


def _as_scalar(value: Any) -> int | float | None:
    """``value`` as a Python number if it is one (bool excluded), a one-element tensor or a numpy scalar; else
    ``None``. Trackers use it to tell metrics from text and other objects."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Number):
        if isinstance(value, (int, float)):
            return value
        return int(value) if isinstance(value, numbers.Integral) else float(value)  # type: ignore[arg-type]
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    try:
        count = numel() if callable(numel) else numel
    except TypeError:
        return None
    if count == 1 and hasattr(value, "item"):
        item = value.item()
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            return item
    return None


def _flatten(config: Mapping[str, Any], sep: str = "/", prefix: str = "") -> dict[str, int | float | str | bool]:
    """Nested mappings flattened to ``{"optim/lr": 0.1}``; values that are not int/float/str/bool become strings
    (lists, None, paths, dtypes), scalar tensors become numbers. For hyper-parameter tables."""
    flat: dict[str, int | float | str | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(_flatten(value, sep, name))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            number = _as_scalar(value)
            flat[name] = number if number is not None else str(value)
    return flat


def __getattr__(name: str) -> Any:
    """accel-kernel 0.1.0's plugins imported ``requested``, ``as_scalar`` and ``flatten`` from here: they are
    :mod:`accel.spi`'s (the only module a plugin imports from accel), and the old import warns naming it
    (:mod:`accel.deprecations`). The helpers are defined here as ``_requested``, ``_as_scalar``, ``_flatten``."""
    from accel.deprecations import attribute

    return attribute(__name__, name)


class TrackingKernel(Protocol):
    """What :class:`Tracking` reads of its Kernel."""

    plugins: Plugins
    settings: Settings

    @property
    def is_main_process(self) -> bool: ...

    def call_isolated(self, hook_name: str, *, trackers: bool | None = None, **kwargs: Any) -> None: ...


class Tracking:
    """A Kernel's part for its tracker API (its ``_tracking``; the Kernel offers each public member under the same
    name, documented in :class:`accel.parts.TrackingPart`): it checks the arguments and calls the tracking hooks on
    the active trackers, each isolated."""

    def __init__(self, kernel: TrackingKernel) -> None:
        check_tracker_names(kernel.settings["log_with"] or [], kernel.plugins.records)
        self.kernel = kernel
        self.started = False  # init_trackers was called
        self.ended = False  # and the runs it started are finished
        self._warned: set[str] = set()

    @property
    def log_with(self) -> list[str]:
        return list(self.kernel.settings["log_with"] or [])

    @log_with.setter
    def log_with(self, value: str | Sequence[str] | None) -> None:
        names = [value] if isinstance(value, str) else list(value or [])
        if sorted(names) != sorted(self.log_with):
            raise UsageError(
                f"kernel.log_with = {value!r}: trackers are chosen when the Kernel is created (they are plugins); "
                f"pass Kernel(log_with={value!r}) instead (this run has log_with={self.log_with!r})"
            )

    @property
    def trackers(self) -> list[Component]:
        return [c for c in self.kernel.plugins.components if c.role == "tracker"]

    @trackers.setter
    def trackers(self, value: list[Component]) -> None:
        if [id(t) for t in value] != [id(t) for t in self.trackers]:
            raise UsageError(
                "kernel.trackers cannot be replaced: trackers are plugins chosen by Kernel(log_with=[...]); "
                "pass the tracker names there"
            )

    def init_trackers(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        if not isinstance(project_name, str) or not project_name:
            raise UsageError(f"init_trackers(project_name=...) expects a non-empty string, got {project_name!r}")
        for key, value in (init_kwargs or {}).items():
            if not isinstance(value, Mapping):
                raise UsageError(
                    f"init_trackers(init_kwargs=...): the entry for {key!r} must be a dict of keyword "
                    f"arguments, got {type(value).__name__}"
                )
        self.started = True
        self.ended = False
        self.kernel.call_isolated(
            "accel_init_trackers",
            kernel=self.kernel,
            project_name=project_name,
            config=dict(config or {}),
            init_kwargs={k: dict(v) for k, v in (init_kwargs or {}).items()},
        )

    def _tracking_ready(self, what: str) -> bool:
        if not self.trackers:
            return False
        if not self.started:
            self._warn_once(
                f"{what}-before-init", f"kernel.{what}() was called before kernel.init_trackers(); nothing was logged"
            )
            return False
        return True

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        if not self._tracking_ready("log"):
            return
        self.kernel.call_isolated(
            "accel_log",
            kernel=self.kernel,
            values=dict(values),
            step=step,
            log_kwargs={k: dict(v) for k, v in (log_kwargs or {}).items()},
        )

    def log_images(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        if not self._tracking_ready("log_images"):
            return
        self._warn_unsupported("accel_log_images", "log_images")
        self.kernel.call_isolated(
            "accel_log_images",
            kernel=self.kernel,
            values=dict(values),
            step=step,
            log_kwargs={k: dict(v) for k, v in (log_kwargs or {}).items()},
        )

    def log_table(
        self,
        table_name: str,
        columns: Sequence[str] | None = None,
        data: Iterable[Sequence[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        if dataframe is not None:
            if columns is not None or data is not None:
                raise UsageError("log_table: give either columns and data, or dataframe, not both")
            columns = [str(c) for c in dataframe.columns]
            data = dataframe.values.tolist()
        if columns is None or data is None:
            raise UsageError("log_table needs columns and data (or a dataframe)")
        rows = [list(row) for row in data]
        bad = [i for i, row in enumerate(rows) if len(row) != len(columns)]
        if bad:
            raise UsageError(f"log_table: row {bad[0]} has {len(rows[bad[0]])} values for {len(columns)} columns")
        if not self._tracking_ready("log_table"):
            return
        self._warn_unsupported("accel_log_table", "log_table")
        self.kernel.call_isolated(
            "accel_log_table",
            kernel=self.kernel,
            table_name=table_name,
            columns=list(columns),
            data=rows,
            step=step,
            log_kwargs={k: dict(v) for k, v in (log_kwargs or {}).items()},
        )

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        for comp in self.trackers:
            if comp.name == name:
                return getattr(comp, "run", None) if unwrap else comp
        active = ", ".join(c.name for c in self.trackers) or "none"
        raise UsageError(f"no active tracker named {name!r} (active trackers: {active}); add it to log_with")

    def end(self) -> None:
        """Finish every tracker run that init_trackers started (once)."""
        if self.started and not self.ended:
            self.ended = True
            self.kernel.call_isolated("accel_end_training", kernel=self.kernel, trackers=True)

    def _warn_unsupported(self, hook: str, what: str) -> None:
        answering = {
            impl.plugin_name
            for impl in getattr(self.kernel.plugins.pm.hook, hook).get_hookimpls()
            if not (impl.wrapper or impl.hookwrapper)
        }  # a wrapper alone logs nothing
        if not answering:
            names = ", ".join(c.name for c in self.trackers)
            self._warn_once(
                hook, f"kernel.{what}(): none of the active trackers ({names}) can log this; nothing was logged"
            )

    def _warn_once(self, key: str, message: str) -> None:
        """Warn about a tracking call once, on the main process (every process makes the same call)."""
        if key not in self._warned and self.kernel.is_main_process:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())
