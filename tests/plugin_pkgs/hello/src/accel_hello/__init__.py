"""accel-plugin-hello: a small third-party plugin, the way one is written outside the accel repository.

The entry point (group ``accel``, name ``hello``) names this module. It implements only discovery hooks and does
not import torch; the runtime hooks live on :class:`accel_hello.observer.HelloObserver`, which takes part in a run
only when the user selects it (``accel launch --plugin hello`` or ``Kernel(plugins=["hello"])``).
"""

from __future__ import annotations

from accel import Component, Options, Settings, hookimpl

NAME = "hello"
accel_components = ["accel_hello.observer:HelloObserver"]


@hookimpl
def accel_add_options(options: Options) -> None:
    options.add(
        "hello_greeting",
        default="hello",
        env=("ACCEL_HELLO_GREETING",),
        help="What the hello plugin says when a model is prepared.",
    )


@hookimpl
def accel_activate(settings: Settings) -> Component | None:
    if not settings.is_selected(NAME):
        return None
    from accel_hello.observer import HelloObserver

    return HelloObserver(settings["hello_greeting"])
