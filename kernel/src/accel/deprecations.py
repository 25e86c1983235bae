"""Deprecated plugin-facing names: one table, one way to warn and one way to fail.

A hook, a conformance-kit method or a name of the plugin API that is renamed or removed first becomes an entry of
:data:`DEPRECATIONS` (name -> replacement, the release that deprecated it, the release that removes it, and the
migration in one sentence). From ``deprecated_in`` on it keeps working and warns (a ``DeprecationWarning`` naming the
replacement); from ``removed_in`` on (compared with the installed accel-kernel's version) using it fails with one
line naming the replacement. The entry stays in the table after the removal, so the error and the misspelt-hook
did-you-mean keep pointing at the replacement.

- **Hooks** (``kind="hook"``) stay real hookspecs until ``removed_in`` (hookspecs.py, section "Deprecated"), declared
  with pluggy's ``warn_on_impl=``:func:`hook_warning`, so pluggy warns when a plugin implementing one is registered;
  the kernel still calls them. From ``removed_in`` on, a plugin implementing one is refused
  (:func:`accel.plugins.contract_problem`), and the hookspec must be deleted (a test checks it).
- **Kit methods** (``kind="kit"``): the kit calls :func:`warn_or_fail` where it falls back on the old method.
- **Names** (``kind="name"``, ``"module.Name"``): a module's ``__getattr__`` answers a name it no longer has with
  :func:`attribute`, which warns and returns the replacement, or fails naming it.

The policy (semantic versions, what ``accel.spi.API_VERSION`` means) is in docs/plugin-api.md, "Stability".
"""

from __future__ import annotations

import difflib
import functools
import importlib
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from accel import version
from accel.errors import PluginError

KINDS = ("hook", "kit", "name")


@dataclass(frozen=True)
class Deprecation:
    """One deprecated name: what plugins wrote, what to write instead, and when it warns and when it fails."""

    name: str  # a hook ("accel_wrap_model"), a kit method ("TrackerConformance.read_scalars"), a name ("accel.spi.X")
    replacement: str  # what to use instead
    deprecated_in: str  # the accel-kernel release from which using it warns
    removed_in: str  # the accel-kernel release from which using it fails
    how: str  # the migration, one sentence
    kind: str = "hook"  # one of KINDS

    def removed(self, version: str | None = None) -> bool:
        """Whether ``version`` (default: the installed accel-kernel's) is at or past ``removed_in``."""
        return release(version or kernel_version()) >= release(self.removed_in)

    def warning_line(self) -> str:
        return (
            f"{self.name} is deprecated since accel-kernel {self.deprecated_in} and fails from {self.removed_in}: "
            f"use {self.replacement} ({self.how})"
        )

    def error_line(self) -> str:
        return f"{self.name} was removed in accel-kernel {self.removed_in}: use {self.replacement} ({self.how})"


#: Every deprecated name, in the order deprecated. Entries stay after their removal (for the errors).
DEPRECATIONS: dict[str, Deprecation] = {
    entry.name: entry
    for entry in (
        Deprecation(
            "accel_wrap_model",
            "accel_prepare_training",
            "0.1.1",
            "0.2.0",
            "implement accel_prepare_training(kernel, models, optimizers, schedulers) and return the placed and "
            "wrapped models with the optimizers and schedulers, see docs/writing-plugins.md",
        ),
        Deprecation(
            "accel_wrap_optimizer",
            "accel_prepare_training",
            "0.1.1",
            "0.2.0",
            "adapt the optimizers in the accel_prepare_training that wraps the models and return them in its "
            "second list",
        ),
        Deprecation(
            "TrackerConformance.read_scalars",
            "TrackerConformance.read_series",
            "0.1.1",
            "0.2.0",
            "return every recorded point in order, {key: [(step, value), ...]}, duplicates kept",
            kind="kit",
        ),
        *(
            Deprecation(
                f"accel.tracking.{name}",
                f"accel.spi.{name}",
                "0.1.1",
                "0.2.0",
                f"write `from accel.spi import {name}`: accel.spi is the only module of accel a plugin imports",
                kind="name",
            )
            for name in ("requested", "as_scalar", "flatten")
        ),
        *(
            Deprecation(
                f"accel.compat.{name}",
                f"accel.{name}",
                "0.1.1",
                "0.2.0",
                f"write `from accel import {name}` (accel.compat became accel.data_arguments; the tables of "
                "Accelerate's names moved to accel-accelerate: accel_accelerate.names)",
                kind="name",
            )
            for name in ("DataLoaderConfiguration", "GradientAccumulationPlugin")
        ),
        *(
            Deprecation(
                f"{module}.{name}",
                replacement,
                "0.1.1",
                "0.2.0",
                f"{how}; or run the script unchanged on accel-accelerate, where `{module.replace('accel', 'accelerate', 1)}` "
                "is Accelerate's",
                kind="name",
            )
            for module, how, names in (
                (
                    "accel.accelerator",
                    "import it from accel",
                    {
                        "Kernel": "accel.Kernel",
                        "DataLoaderConfiguration": "accel.DataLoaderConfiguration",
                        "GradientAccumulationPlugin": "accel.GradientAccumulationPlugin",
                        "ProjectConfiguration": "accel.ProjectConfiguration",
                    },
                ),
                (
                    "accel.state",
                    "import it from accel",
                    {"PartialState": "accel.PartialState", "GradientState": "accel.GradientState"},
                ),
                (
                    "accel.data_loader",
                    "import it from accel",
                    {
                        "DataLoaderConfiguration": "accel.DataLoaderConfiguration",
                        "skip_first_batches": "accel.skip_first_batches",
                    },
                ),
                (
                    "accel.test_utils",
                    "import it from accel.testing.regression",
                    {
                        name: f"accel.testing.regression.{name}"
                        for name in ("RegressionDataset", "RegressionModel", "assert_exception")
                    },
                ),
                (
                    "accel.test_utils.testing",
                    "import it from accel.testing.regression",
                    {"assert_exception": "accel.testing.regression.assert_exception"},
                ),
            )
            for name, replacement in names.items()
        ),
    )
}


def release(version: str) -> tuple[int, int, int]:
    """``"0.1.1"`` -> ``(0, 1, 1)`` (a pre-release or local suffix is ignored: ``"0.2.0.dev1"`` is 0.2.0)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"version {version!r} is not MAJOR.MINOR.PATCH")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


@functools.cache
def kernel_version() -> str:
    """The installed accel-kernel's version."""
    return version.kernel_version()


def hook_warning(name: str) -> DeprecationWarning:
    """The warning pluggy gives when a plugin implementing deprecated hook ``name`` is registered (``warn_on_impl``)."""
    return DeprecationWarning(DEPRECATIONS[name].warning_line())


def warn_or_fail(name: str, stacklevel: int = 3) -> None:
    """Using deprecated ``name``: a ``DeprecationWarning`` naming its replacement, or, from its ``removed_in`` on, a
    :class:`accel.PluginError` naming it."""
    entry = DEPRECATIONS[name]
    if entry.removed():
        raise PluginError(entry.error_line())
    warnings.warn(entry.warning_line(), DeprecationWarning, stacklevel=stacklevel)


def deprecated_hooks(names: Iterable[str]) -> list[Deprecation]:
    """The entries of the deprecated (or removed) hooks among ``names``."""
    return [DEPRECATIONS[n] for n in names if n in DEPRECATIONS and DEPRECATIONS[n].kind == "hook"]


def removed_hooks(names: Iterable[str]) -> list[Deprecation]:
    """The entries of the hooks among ``names`` that are removed in the installed kernel."""
    return [entry for entry in deprecated_hooks(names) if entry.removed()]


def deprecated_hooks_note(names: Iterable[str]) -> str:
    """One line for ``accel plugins`` about the deprecated hooks among ``names`` (``""`` when none)."""
    return "; ".join(
        f"{e.name} is deprecated, fails from {e.removed_in}: use {e.replacement}" for e in deprecated_hooks(names)
    )


def hook_suggestion(word: str, hooks: Iterable[str]) -> str:
    """``"; did you mean `x`?"`` for a misspelt hook name: the closest of ``hooks`` and the deprecated hooks, a
    deprecated one replaced by its replacement (``accel_wrap_modle`` -> ``accel_prepare_training``); or ``""``."""
    deprecated = {e.name: e.replacement for e in deprecated_hooks(DEPRECATIONS)}
    match = difflib.get_close_matches(word, [*hooks, *deprecated], n=1, cutoff=0.6)
    return f"; did you mean `{deprecated.get(match[0], match[0])}`?" if match else ""


def attribute(module: str, name: str) -> Any:
    """For a module's ``__getattr__``: the replacement of ``module.name`` when it is a deprecated name (with a
    warning naming it), an ``AttributeError`` naming the replacement once removed, and the usual ``AttributeError``
    for a name that never was."""
    entry = DEPRECATIONS.get(f"{module}.{name}")
    if entry is None or entry.kind != "name":
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    if entry.removed():
        raise AttributeError(entry.error_line())
    warnings.warn(entry.warning_line(), DeprecationWarning, stacklevel=3)
    target, _, attr = entry.replacement.rpartition(".")
    return getattr(importlib.import_module(target), attr)


__all__ = [
    "DEPRECATIONS",
    "Deprecation",
    "attribute",
    "deprecated_hooks",
    "deprecated_hooks_note",
    "hook_suggestion",
    "hook_warning",
    "release",
    "warn_or_fail",
]
