"""accel-plugin-jsonl: the entry-point module.

accel imports this module for every command (``accel --help``, ``accel plugins``), so it only holds the
*discovery* hooks and imports nothing heavy. The runtime hooks live on the component in ``tracker.py``.
"""

from __future__ import annotations

from accel.spi import Settings, hookimpl, requested

NAME = "jsonl"
#: Lets ``accel plugins`` show the runtime hooks of the component without activating it.
accel_components = ["accel_jsonl.tracker:JsonlTracker"]


@hookimpl
def accel_activate(settings: Settings) -> object | None:
    """Take part in the run when ``log_with`` names this tracker (or is ``"all"``)."""
    if requested(settings, NAME):
        from accel_jsonl.tracker import JsonlTracker

        return JsonlTracker()
    return None
