"""The built-in plugins: the kernel's own features, registered the way installed plugins are.

As pytest's ``default_plugins``: :data:`BUILTIN_PLUGINS` names each feature's plugin module, and
:meth:`accel.plugins.Plugins.load` registers every one of them by name with ``pm.register`` before the installed
plugins, so each answers its hooks through pluggy exactly as an installed plugin would (with ``trylast=True``: any
installed plugin's answer comes first). They are listed with status ``built-in`` by ``accel plugins``, shown in the
``accel launch --dry-run`` hook table and traced by ``ACCEL_TRACE_PLUGINS=1``. They cannot be disabled: every
hook of the contract needs an answer.

Their modules import no torch (the CLI registers them too): each imports its feature on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

#: (plugin name, module) of each built-in plugin, in registration order.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("accel", "accel.defaults"),  # one process, one device: the answer of every hook nobody else answers
    ("accel.data", "accel.builtin.data"),  # data sharding: each process reads its own shard
    ("accel.checkpoint", "accel.builtin.checkpoint"),  # the checkpoint writer (save_state/load_state)
    ("accel.memory", "accel.builtin.memory"),  # accel estimate-memory's single-process row
)

#: The parts of a Kernel that built-in features give it: (the Kernel's attribute, "module:class"). Each class is made
#: with the Kernel when it starts (:func:`make_parts`); :mod:`accel.parts` says what each offers.
BUILTIN_PARTS: tuple[tuple[str, str], ...] = (
    ("_tracking", "accel.tracking:Tracking"),  # init_trackers, log, get_tracker...
    ("_checkpoints", "accel.builtin.checkpoint:Checkpoints"),  # save_state, load_state, save_model...
)


def make_parts(kernel: Any) -> dict[str, Any]:
    """The built-in parts of ``kernel``, by attribute name, each made from its class named in :data:`BUILTIN_PARTS`
    (imported by name, as the built-in plugins are: the kernel imports no feature)."""
    parts = {}
    for attribute, where in BUILTIN_PARTS:
        module, name = where.split(":")
        parts[attribute] = getattr(importlib.import_module(module), name)(kernel)
    return parts


#: The distribution the built-in plugins come with.
DISTRIBUTION = "accel-kernel"

_NAMES = frozenset(name for name, _ in BUILTIN_PLUGINS)


def is_builtin(name: str) -> bool:
    """Whether ``name`` (a plugin name as pluggy registered it) is one of the built-in plugins."""
    return name in _NAMES
