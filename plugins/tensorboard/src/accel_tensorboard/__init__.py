"""accel-plugin-tensorboard: the entry-point module. Cheap to import: neither torch nor the backend is imported here."""

from __future__ import annotations

from accel.spi import Settings, hookimpl, requested

NAME = "tensorboard"
accel_components = ["accel_tensorboard.tracker:TensorBoardTracker"]


@hookimpl
def accel_activate(settings: Settings) -> object | None:
    """Take part when ``log_with`` names this tracker (or is "all")."""
    if requested(settings, NAME):
        from accel_tensorboard.tracker import TensorBoardTracker

        return TensorBoardTracker()
    return None
