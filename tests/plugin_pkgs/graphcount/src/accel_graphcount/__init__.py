"""accel-plugin-graphcount: a compiler plugin with one backend of its own, ``dynamo_backend=graphcount``.

Its component class declares ``compile:graphcount`` (not ``compile``: it is not every backend), so the kernel
accepts the backend at discovery and, where accel-plugin-dynamo (``compile``: every backend) is installed too, asks
only this plugin when the run wants ``graphcount``. No torch import here.
"""

from __future__ import annotations

from accel.spi import Component, Settings, hookimpl

BACKEND = "graphcount"
accel_components = ["accel_graphcount.compiler:GraphCountCompiler"]


@hookimpl
def accel_activate(settings: Settings) -> Component | None:
    if str(settings.get("dynamo_backend") or "no") != BACKEND:
        return None
    from accel_graphcount.compiler import GraphCountCompiler

    return GraphCountCompiler()
