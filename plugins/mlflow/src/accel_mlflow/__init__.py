"""accel-plugin-mlflow: the entry-point module. Cheap to import: neither torch nor the backend is imported here."""

from __future__ import annotations

from accel.spi import Settings, hookimpl, requested

NAME = "mlflow"
accel_components = ["accel_mlflow.tracker:MLflowTracker"]


@hookimpl
def accel_activate(settings: Settings) -> object | None:
    """Take part when ``log_with`` names this tracker (or is "all")."""
    if requested(settings, NAME):
        from accel_mlflow.tracker import MLflowTracker

        return MLflowTracker()
    return None
