"""A plugin whose component class misspells a runtime hook (``accel_prepare_trainin``): found when plugins are
discovered (the class is listed in ``accel_components``), so ``accel plugins`` shows the plugin failed."""

from __future__ import annotations

from typing import Any

from accel import Component, Settings, hookimpl

accel_components = ["accel_badcomponent:Typo"]


class Typo(Component):
    role = "observer"

    @hookimpl
    def accel_prepare_trainin(self, kernel: Any, models: Any) -> Any:  # should be accel_prepare_training
        return None


@hookimpl
def accel_activate(settings: Settings) -> Component | None:
    return Typo() if settings.is_selected("badcomponent") else None
