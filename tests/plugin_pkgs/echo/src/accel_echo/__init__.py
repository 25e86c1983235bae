"""accel-plugin-echo: implements ``accel_shout_words``, the hook plugin shout adds (accel-plugin-shout). Marked
``optionalhook``, so echo still loads where shout is not installed. No torch import here."""

from __future__ import annotations

from accel.spi import Component, Settings, hookimpl

NAME = "echo"
accel_components = ["accel_echo.component:Echo"]


@hookimpl
def accel_activate(settings: Settings) -> Component | None:
    if not settings.is_selected(NAME):
        return None
    from accel_echo.component import Echo

    return Echo()
