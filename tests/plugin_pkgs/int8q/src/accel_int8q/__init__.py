"""accel-plugin-int8q: a precision plugin with a mode of its own, ``mixed_precision=int8``.

Its component class declares ``precision:int8`` in ``provides`` and is listed in ``accel_components``, so the kernel
knows the mode at discovery, without activating the plugin or importing torch: ``--mixed_precision int8``,
``Kernel(mixed_precision="int8")``, ``ACCEL_MIXED_PRECISION=int8`` and ``mixed_precision: int8`` in a config file are
accepted wherever this plugin is installed. No torch import here.
"""

from __future__ import annotations

from accel.spi import Component, Settings, hookimpl

MODE = "int8"
accel_components = ["accel_int8q.precision:Int8Precision"]


@hookimpl
def accel_activate(settings: Settings) -> Component | None:
    if settings.mixed_precision != MODE:
        return None
    from accel_int8q.precision import Int8Precision

    return Int8Precision()
