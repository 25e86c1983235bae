"""accel-plugin-mlflow against the real thing: a real ``mlflow server`` (sqlite backend, started once per
session, see plugins/mlflow/tests/mlflow_server.py); the plugin logs to it over HTTP with the mlflow-skinny client and the tests
read params, metrics and artifacts back with ``MlflowClient``."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlflow_server import running_server

from accel.testing import free_port, make_kernel, patched_environ
from accel.testing.conformance import TrackerConformance

pytestmark = pytest.mark.timeout(900)  # the first session on a machine installs the server (about a minute)


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(tmp_path_factory.mktemp("mlflow-server")) as uri:
        yield uri


def client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def runs_of(uri: str, project: str, tag: str) -> list[Any]:
    """The runs of experiment ``project`` that one test made (tagged with its tmp dir's name)."""
    experiment = client(uri).get_experiment_by_name(project)
    if experiment is None:
        return []
    return client(uri).search_runs([experiment.experiment_id], filter_string=f"tags.accel_test = '{tag}'")


class TestMLflowConformance(TrackerConformance):
    name = "mlflow"
    backend_modules = ("mlflow",)

    @pytest.fixture(autouse=True)
    def _server(self, mlflow_uri: str) -> None:
        self.uri = mlflow_uri

    def init_kwargs(self, tmp_path: Path) -> dict[str, Any]:
        return {"tracking_uri": self.uri, "tags": {"accel_test": tmp_path.name}}

    def environment(self, tmp_path: Path) -> dict[str, str]:
        return {"MLFLOW_TRACKING_URI": self.uri}

    def read_series(self, tmp_path: Path, project: str) -> dict[str, list[tuple[int, float]]]:
        series: dict[str, list[tuple[int, float]]] = {}
        for run in runs_of(self.uri, project, tmp_path.name):
            for key in run.data.metrics:
                history = client(self.uri).get_metric_history(run.info.run_id, key)
                series.setdefault(key, []).extend((m.step, m.value) for m in sorted(history, key=lambda m: m.timestamp))
        return series

    def read_config(self, tmp_path: Path, project: str) -> dict[str, str]:
        (run,) = runs_of(self.uri, project, tmp_path.name)
        return dict(run.data.params)

    def count_runs(self, tmp_path: Path, project: str) -> int:
        return len(runs_of(self.uri, project, tmp_path.name))


@pytest.fixture
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    kernel = make_kernel(["mlflow"], log_with="mlflow", project_dir=tmp_path / "project")
    yield kernel
    kernel.end_training()


def test_run_options_media_and_status_read_back(kernel: Any, mlflow_uri: str, tmp_path: Path) -> None:
    many = {f"p{i:03d}": i for i in range(150)}  # more than one batch of params
    kernel.init_trackers(
        "media",
        config={"long": "x" * 10000, **many},
        init_kwargs={
            "mlflow": {
                "tracking_uri": mlflow_uri,
                "run_name": "my-run",
                "experiment_name": "accel-media",
                "tags": {"accel_test": tmp_path.name},
                "description": "a test run",
            }
        },
    )
    active = kernel.get_tracker("mlflow", unwrap=True)
    run_id = active.info.run_id
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel.log({"loss": 0.5, "note": "text is not a metric", "lr": {"g0": 0.1}}, step=1)
        kernel.log({"loss": 0.25, "note": "again"}, step=2)
    assert [str(w.message) for w in caught] == ["mlflow: only numbers are logged as metrics; 'note' (str) is skipped"]
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    kernel.log_images({"sample": image}, step=3)
    kernel.log_table("predictions", columns=["text", "label"], data=[["a", 1], ["b", 0]], step=3)
    kernel.end_training()

    c = client(mlflow_uri)
    run = c.get_run(run_id)
    assert run.info.run_name == "my-run" and run.info.status == "FINISHED"
    assert c.get_experiment(run.info.experiment_id).name == "accel-media"
    assert run.data.params["p149"] == "149" and len(run.data.params) == 151
    assert len(run.data.params["long"]) < 10000  # truncated to MLflow's limit
    assert [(m.step, m.value) for m in c.get_metric_history(run_id, "loss")] == [(1, 0.5), (2, 0.25)]
    assert run.data.metrics["lr/g0"] == 0.1
    artifacts = {a.path for a in c.list_artifacts(run_id)}
    assert {"images", "tables"} <= artifacts, artifacts
    table = json.loads(Path(c.download_artifacts(run_id, "tables/predictions_step3.json", str(tmp_path))).read_text())
    assert table == {"columns": ["text", "label"], "data": [["a", 1], ["b", 0]]}
    assert any("sample" in a.path for a in c.list_artifacts(run_id, "images"))


@pytest.mark.requires_plugins("tensorboard")
def test_server_gone_is_warned_once_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens at the tracking URI: MLflow raises, the tracker is skipped, TensorBoard still records."""
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    dead = f"http://127.0.0.1:{free_port()}"
    with patched_environ({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}):
        kernel = make_kernel(
            ["mlflow", "tensorboard"], log_with=["mlflow", "tensorboard"], project_dir=tmp_path / "project"
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel.init_trackers("gone", config={"lr": 0.1}, init_kwargs={"mlflow": {"tracking_uri": dead}})
            for step in range(3):
                kernel.log({"loss": float(step)}, step=step)
            kernel.end_training()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "tracker 'mlflow' failed in accel_init_trackers" in messages[0], messages
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "project" / "gone"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [0, 1, 2]


@pytest.mark.parametrize("given", [None, "sqlite:///elsewhere.db"])
def test_the_tracking_uri_does_not_leak_into_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str | None
) -> None:
    """mlflow.set_tracking_uri also writes os.environ["MLFLOW_TRACKING_URI"]: the subprocesses a script starts after
    the run (a test's, a launcher's) would report to it. The tracker keeps the URI for its client only."""
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if given is not None:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", given)
    uri = (tmp_path / "runs").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    kernel = make_kernel(["mlflow"], log_with="mlflow", project_dir=tmp_path / "project")
    kernel.init_trackers("leak", init_kwargs={"mlflow": {"tracking_uri": uri}})
    kernel.log({"loss": 1.0}, step=0)
    kernel.end_training()
    import os

    import mlflow

    assert os.environ.get("MLFLOW_TRACKING_URI") == given
    assert mlflow.get_tracking_uri() == uri  # the client still reports where it was told
