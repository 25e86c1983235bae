"""A second distribution that claims the plugin name ``hello``: both must be refused, naming both."""

from __future__ import annotations

from accel import Settings, hookimpl


@hookimpl
def accel_activate(settings: Settings) -> None:
    return None
