"""A plugin whose accel_activate raises: runs that do not select it must not be blocked."""

from accel import Component, Settings, hookimpl


@hookimpl
def accel_activate(settings: Settings) -> Component | None:
    raise RuntimeError("badactivate cannot decide whether to take part (on purpose)")
