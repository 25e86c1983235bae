"""The MLflow tracker component. mlflow is imported inside the methods."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.spi import Tracker, as_scalar, flatten, hookimpl

if TYPE_CHECKING:
    from accel.spi import KernelView

#: init_kwargs["mlflow"] keys that are not arguments of mlflow.start_run.
_OWN_KEYS = ("tracking_uri", "experiment_name", "artifact_location", "experiment_tags")
_PARAMS_PER_CALL = 100  # MLflow refuses more than 100 params in one batch


def _image(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def default_tracking_uri(project_dir: str | None) -> str:
    """Where runs go when neither ``tracking_uri`` nor ``MLFLOW_TRACKING_URI`` says: in the Kernel's ``project_dir``
    (else the working directory), MLflow's default database (``mlflow.db``) where its database packages are
    installed, else a file store (``mlruns``): mlflow-skinny has no SQLAlchemy for MLflow's own default and refuses
    the file store unless ``MLFLOW_ALLOW_FILE_STORE`` allows it, which this sets for the process."""
    import importlib.util
    import pathlib

    base = pathlib.Path(project_dir or os.getcwd()).resolve()
    base.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("sqlalchemy") and importlib.util.find_spec("alembic"):
        return f"sqlite:///{base / 'mlflow.db'}"
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (base / "mlruns").as_uri()


def set_tracking_uri(uri: str) -> None:
    """``mlflow.set_tracking_uri`` for this process's MLflow client only: MLflow also writes the URI into
    ``os.environ["MLFLOW_TRACKING_URI"]``, so every process the script starts afterwards (a test's subprocess, a
    launcher) would report to it, still after the run ended and its server went away (each then spends minutes in
    MLflow's retries). The variable is put back as it was; the client keeps the URI."""
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


class MLflowTracker(Tracker):
    """One MLflow run per ``init_trackers``: experiment ``project_name`` (or ``experiment_name`` /
    ``MLFLOW_EXPERIMENT_NAME``), the config as params, numbers as metrics.

    ``init_kwargs["mlflow"]``: ``tracking_uri`` (else ``MLFLOW_TRACKING_URI``, else ``mlflow.db`` or, with
    mlflow-skinny, ``mlruns/`` in ``project_dir`` or the working directory),
    ``experiment_name``, ``artifact_location``, ``experiment_tags``, and any argument of ``mlflow.start_run``
    (``run_name``, ``run_id``, ``tags``, ``nested``, ``description``). ``get_tracker("mlflow", unwrap=True)`` is the
    ``mlflow.ActiveRun``."""

    provides = frozenset({"tracker:mlflow"})

    def __init__(self) -> None:
        self.run = None
        self._skipped: set[str] = set()

    @hookimpl
    def accel_init_trackers(
        self, kernel: KernelView, project_name: str, config: Mapping[str, Any], init_kwargs: Mapping[str, Any]
    ) -> None:
        import mlflow

        kwargs = dict(init_kwargs.get("mlflow", {}))
        own = {k: kwargs.pop(k) for k in _OWN_KEYS if k in kwargs}
        if own.get("tracking_uri"):
            set_tracking_uri(own["tracking_uri"])
        elif not os.environ.get("MLFLOW_TRACKING_URI"):
            set_tracking_uri(default_tracking_uri(kernel.project_dir))
        name = own.get("experiment_name") or os.environ.get("MLFLOW_EXPERIMENT_NAME") or project_name
        experiment = mlflow.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = mlflow.create_experiment(
                name, artifact_location=own.get("artifact_location"), tags=own.get("experiment_tags")
            )
        self.run = mlflow.start_run(experiment_id=experiment_id, **kwargs)
        if config:
            try:
                from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
            except ImportError:  # pragma: no cover - older or newer layouts
                limit = 500
            params = [(k, str(v)[:limit]) for k, v in flatten(config).items()]
            for i in range(0, len(params), _PARAMS_PER_CALL):
                mlflow.log_params(dict(params[i : i + _PARAMS_PER_CALL]))

    @hookimpl
    def accel_log(
        self, kernel: KernelView, values: Mapping[str, Any], step: int | None, log_kwargs: Mapping[str, Any]
    ) -> None:
        import mlflow

        metrics: dict[str, float] = {}
        for key, value in values.items():
            number = as_scalar(value)
            if number is not None:
                metrics[key] = float(number)
            elif isinstance(value, Mapping) and all(as_scalar(v) is not None for v in value.values()):
                metrics.update({f"{key}/{k}": float(as_scalar(v)) for k, v in value.items()})  # type: ignore[arg-type]
            elif key not in self._skipped:
                self._skipped.add(key)
                warnings.warn(
                    f"mlflow: only numbers are logged as metrics; {key!r} ({type(value).__name__}) is skipped",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if metrics:
            mlflow.log_metrics(metrics, step=step, **log_kwargs.get("mlflow", {}))

    @hookimpl
    def accel_log_images(
        self, kernel: KernelView, values: Mapping[str, Any], step: int | None, log_kwargs: Mapping[str, Any]
    ) -> None:
        import mlflow

        for key, value in values.items():
            images = value if isinstance(value, (list, tuple)) else [value]
            for i, image in enumerate(images):
                name = key if len(images) == 1 else f"{key}/{i}"
                mlflow.log_image(_image(image), key=name, step=step or 0, **log_kwargs.get("mlflow", {}))

    @hookimpl
    def accel_log_table(
        self,
        kernel: KernelView,
        table_name: str,
        columns: list[str],
        data: list[list[Any]],
        step: int | None,
        log_kwargs: Mapping[str, Any],
    ) -> None:
        import mlflow

        # The layout mlflow.log_table writes (pandas "split" orientation), without needing pandas.
        name = table_name if step is None else f"{table_name}_step{step}"
        mlflow.log_dict({"columns": columns, "data": data}, f"tables/{name}.json")

    @hookimpl
    def accel_end_training(self, kernel: KernelView) -> None:
        import mlflow

        if self.run is not None:
            mlflow.end_run()
            self.run = None
