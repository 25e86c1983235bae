"""accel-plugin-shout: a plugin that adds a hook of its own, as pytest's ``pytest_addhooks``.

``accel_hookspecs`` names the module of its hook, ``accel_shout_words`` (:mod:`accel_shout.hookspecs`); when
selected, its component asks every active component for words through the kernel's hook relay when a model is
prepared, and prints them. No torch import here.
"""

from __future__ import annotations

from accel.spi import Component, Settings, hookimpl

NAME = "shout"
accel_components = ["accel_shout.component:Shouter"]
accel_hookspecs = ["accel_shout.hookspecs"]


@hookimpl
def accel_activate(settings: Settings) -> Component | None:
    if not settings.is_selected(NAME):
        return None
    from accel_shout.component import Shouter

    return Shouter()
