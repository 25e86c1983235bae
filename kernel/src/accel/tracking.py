"""Experiment tracking: the Kernel's tracker API and the base class of tracker components. No torch import.

A tracker is a plugin whose ``accel_activate`` returns a :class:`Tracker` when its name is in ``log_with`` (or
``"all"`` is). The Kernel never names a tracker: it calls the tracking hooks of :mod:`accel.hookspecs` on every
active tracker, each isolated, so that a tracker that raises (bad credentials, server gone) is warned about once
and skipped from then on, and training goes on.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

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


class TrackingMixin:
    """The Kernel's tracking methods (mixed into :class:`accel.Kernel`)."""

    plugins: Plugins
    settings: Settings
    _trackers_started: bool = False
    _trackers_ended: bool = False
    _warned: set[str]

    def call_isolated(self, hook_name: str, **kwargs: Any) -> None:  # implemented by Kernel
        raise NotImplementedError

    @property
    def is_main_process(self) -> bool:  # implemented by Kernel
        raise NotImplementedError

    @property
    def trackers(self) -> list[Component]:
        """The active tracker components, in the order hooks ask them."""
        return [c for c in self.plugins.components if c.role == "tracker"]

    @trackers.setter
    def trackers(self, value: list[Component]) -> None:
        """Accepted when it holds this run's trackers (``kernel.trackers = kernel.trackers``); trackers are plugins
        chosen by ``Kernel(log_with=...)``, so another list is one line saying so."""
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
        """Start a run named ``project_name`` in every tracker of ``log_with`` and record ``config`` (the
        hyper-parameters). ``init_kwargs`` maps a tracker name to keyword arguments for that backend, e.g.
        ``{"my_tracker": {"project": "x"}, "other_tracker": {"uri": "http://..."}}``. Main process only, unless a
        tracker says otherwise."""
        if not isinstance(project_name, str) or not project_name:
            raise UsageError(f"init_trackers(project_name=...) expects a non-empty string, got {project_name!r}")
        for key, value in (init_kwargs or {}).items():
            if not isinstance(value, Mapping):
                raise UsageError(
                    f"init_trackers(init_kwargs=...): the entry for {key!r} must be a dict of keyword "
                    f"arguments, got {type(value).__name__}"
                )
        self._trackers_started = True
        self._trackers_ended = False
        self.call_isolated(
            "accel_init_trackers",
            kernel=self,
            project_name=project_name,
            config=dict(config or {}),
            init_kwargs={k: dict(v) for k, v in (init_kwargs or {}).items()},
        )

    def _tracking_ready(self, what: str) -> bool:
        if not self.trackers:
            return False
        if not self._trackers_started:
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
        """Log a dict of values (numbers, and whatever else a tracker understands) at ``step`` to every active
        tracker. ``log_kwargs`` maps a tracker name to extra keyword arguments for its log call."""
        if not self._tracking_ready("log"):
            return
        self.call_isolated(
            "accel_log",
            kernel=self,
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
        """Log images to the active trackers that can show them. ``values`` maps a name to an image or a list of
        images; an image is an array or tensor of shape H x W, H x W x 3 or H x W x 4 (channels last; uint8 in
        0..255 or float in 0..1) or a PIL image."""
        if not self._tracking_ready("log_images"):
            return
        self._warn_unsupported("accel_log_images", "log_images")
        self.call_isolated(
            "accel_log_images",
            kernel=self,
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
        """Log a table (``columns`` and rows of ``data``, or a pandas ``dataframe``) to the active trackers that can
        show tables."""
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
        self.call_isolated(
            "accel_log_table",
            kernel=self,
            table_name=table_name,
            columns=list(columns),
            data=rows,
            step=step,
            log_kwargs={k: dict(v) for k, v in (log_kwargs or {}).items()},
        )

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The active tracker component called ``name``; with ``unwrap=True`` the backend's own run object
        (``None`` on processes where the tracker did not start a run, e.g. not the main process)."""
        for comp in self.trackers:
            if comp.name == name:
                return getattr(comp, "run", None) if unwrap else comp
        active = ", ".join(c.name for c in self.trackers) or "none"
        raise UsageError(f"no active tracker named {name!r} (active trackers: {active}); add it to log_with")

    def _end_trackers(self) -> None:
        """Finish every tracker run that init_trackers started (once)."""
        if self._trackers_started and not self._trackers_ended:
            self._trackers_ended = True
            self.call_isolated("accel_end_training", kernel=self, trackers=True)

    def _warn_unsupported(self, hook: str, what: str) -> None:
        answering = {
            impl.plugin_name
            for impl in getattr(self.plugins.pm.hook, hook).get_hookimpls()
            if not (impl.wrapper or impl.hookwrapper)
        }  # a wrapper alone logs nothing
        if not answering:
            names = ", ".join(c.name for c in self.trackers)
            self._warn_once(
                hook, f"kernel.{what}(): none of the active trackers ({names}) can log this; nothing was logged"
            )

    def _warn_once(self, key: str, message: str) -> None:
        """Warn about a tracking call once, on the main process (every process makes the same call)."""
        if key not in self._warned and self.is_main_process:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())
