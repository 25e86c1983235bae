"""Conformance suites: what every tracker or strategy plugin must do, as pytest test classes to subclass.

In your plugin's tests::

    from accel.testing.conformance import TrackerConformance

    class TestMyTracker(TrackerConformance):
        name = "mytracker"                 # the entry-point name
        backend_modules = ("mybackend",)   # must not be imported by the entry-point module

        def read_series(self, tmp_path, project):    # what your backend recorded, every point in order:
            ...                                       # {key: [(step, value), ...]}, duplicates kept

        def read_config(self, tmp_path, project):    # the recorded hyper-parameters, flattened with "/"
            ...

pytest collects the inherited ``test_*`` methods. The Kernel used in the tests has ``project_dir=tmp_path /
"project"`` and only your plugin registered; override :meth:`TrackerConformance.init_kwargs` and
:meth:`TrackerConformance.environment` to point the backend somewhere (a server, offline mode).

The suites check behaviour, not only answers: a tracker's records are read back and must hold each logged point
exactly once, in order, and no file under the test's directory may stay open after ``end_training()``; a
strategy's local gradients must stay local on the micro-batches that do not synchronise (and agree after the
ones that do), and ``unwrap_model`` must return the very module object the user prepared.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from accel import Tracker, hookimpl
from accel.deprecations import warn_or_fail
from accel.testing import imported_modules, make_kernel, patched_environ, run_accel, run_launch

CONFIG = {"learning_rate": 0.1, "batch_size": 8, "optimizer": {"name": "sgd", "momentum": 0.9}}
EXPECTED_CONFIG = {"learning_rate": "0.1", "batch_size": "8", "optimizer/name": "sgd", "optimizer/momentum": "0.9"}
STEPS = 5


def loss_at(step: int) -> float:
    return 1.0 / (step + 1)


class BrokenTracker(Tracker):
    """A tracker that raises in every call, like one whose server is gone."""

    provides = frozenset({"tracker:broken"})

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def accel_init_trackers(self, project_name: str) -> None:
        self.calls += 1
        raise ConnectionError("the tracking server is gone")

    @hookimpl
    def accel_log(self, values: Mapping[str, Any]) -> None:
        self.calls += 1
        raise ConnectionError("the tracking server is gone")

    @hookimpl
    def accel_end_training(self) -> None:
        self.calls += 1
        raise ConnectionError("the tracking server is gone")


class BrokenTrackerPlugin:
    """Registers :class:`BrokenTracker` (as plugin ``broken``) when ``log_with`` names it."""

    def __init__(self) -> None:
        self.component = BrokenTracker()

    @hookimpl
    def accel_activate(self, settings: Any) -> Tracker | None:
        return self.component if "broken" in (settings.get("log_with") or []) else None


def open_files_under(directory: Path) -> list[str]:
    """The files under ``directory`` this process holds open (from ``/proc/self/fd``; skips where there is none)."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("no /proc/self/fd on this system: open files cannot be listed")
    root = os.path.realpath(directory)
    found = []
    for fd in os.listdir(fds):
        try:
            target = os.readlink(fds / fd)
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(root + os.sep):
            found.append(os.path.relpath(target, root))
    return sorted(found)


def _accel_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


class _PluginChecks:
    name: str = ""
    role: str = ""
    backend_modules: tuple[str, ...] = ()

    def test_entry_point_module_is_cheap(self) -> None:
        """Neither the entry-point module nor its component classes import torch or the backend at import."""
        heavy = ["torch", *self.backend_modules]
        assert imported_modules(f"accel_{self.name}", heavy) == []

    def test_listed_by_accel_plugins(self, tmp_path: Path) -> None:
        proc = run_accel(["plugins", "--json"], home=tmp_path, registered=[self.name])
        assert proc.returncode == 0, proc.stderr
        rows = {row["name"]: row for row in json.loads(proc.stdout)}
        assert self.name in rows, f"{self.name!r} is not an installed entry point of group 'accel'"
        assert rows[self.name]["status"] == "active", rows[self.name]["reason"]
        assert "accel_activate" in rows[self.name]["hooks"]


class TrackerConformance(_PluginChecks):
    """What a tracker plugin must do. Subclass it (class name starting with ``Test``) and fill in ``name`` and
    the two readers; override the rest as needed."""

    role = "tracker"
    #: Set to False if the tracker deliberately logs on every process (``main_process_only = False``).
    main_process_only: bool = True

    # ---- to fill in -------------------------------------------------------------------------------------------

    def init_kwargs(self, tmp_path: Path) -> dict[str, Any]:
        """Keyword arguments for your backend, passed as ``init_kwargs={name: ...}``."""
        return {}

    def environment(self, tmp_path: Path) -> dict[str, str]:
        """Environment variables the backend needs in the test (offline mode, a tracking URI)."""
        return {}

    def read_series(self, tmp_path: Path, project: str) -> dict[str, list[tuple[int, float]]]:
        """Every point the backend recorded for the run(s) of ``project``, read back from the backend itself:
        ``{key: [(step, value), ...]}`` in the order recorded, duplicates kept (a tracker writing a row twice must
        show it here)."""
        if type(self).read_scalars is not TrackerConformance.read_scalars:  # a suite written for accel-kernel 0.1.0
            warn_or_fail("TrackerConformance.read_scalars")
            return {key: sorted(points.items()) for key, points in self.read_scalars(tmp_path, project).items()}
        raise NotImplementedError(f"{type(self).__name__} must implement read_series(tmp_path, project)")

    def read_scalars(self, tmp_path: Path, project: str) -> dict[str, dict[int, float]]:
        """``{key: {step: value}}``, from :meth:`read_series`."""
        return {key: dict(points) for key, points in self.read_series(tmp_path, project).items()}

    def read_config(self, tmp_path: Path, project: str) -> dict[str, str]:
        """The hyper-parameters recorded for ``project``, nested keys joined with "/", values as strings."""
        raise NotImplementedError

    def count_runs(self, tmp_path: Path, project: str) -> int:
        """How many runs the backend holds for ``project`` (for the multi-process test; optional)."""
        raise NotImplementedError

    # ---- helpers ----------------------------------------------------------------------------------------------

    @pytest.fixture(autouse=True)
    def _tracker_environment(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        home = tmp_path / "accel_home"
        home.mkdir(exist_ok=True)
        monkeypatch.setenv("ACCEL_HOME", str(home))
        with patched_environ(self.environment(tmp_path)):
            yield

    def kernel(self, tmp_path: Path, log_with: list[str] | None = None, extra: Any = ()) -> Any:
        return make_kernel(
            [self.name], extra, log_with=[self.name] if log_with is None else log_with, project_dir=tmp_path / "project"
        )

    def _init_kwargs(self, tmp_path: Path) -> dict[str, Any]:
        return {self.name: self.init_kwargs(tmp_path)}

    def _log_steps(self, kernel: Any, tmp_path: Path, project: str) -> None:
        kernel.init_trackers(project, config=CONFIG, init_kwargs=self._init_kwargs(tmp_path))
        for step in range(STEPS):
            kernel.log({"loss": loss_at(step), "accuracy": step / 10}, step=step)

    def _check_scalars(self, tmp_path: Path, project: str) -> None:
        """Each of the STEPS ``kernel.log`` calls recorded exactly once, in order, with its step and value."""
        series = self.read_series(tmp_path, project)
        assert set(series) >= {"loss", "accuracy"}, f"recorded keys: {sorted(series)}"
        for key, value_at in (("loss", loss_at), ("accuracy", lambda step: step / 10)):
            steps = [step for step, _ in series[key]]
            assert len(steps) == STEPS, (
                f"{key!r}: {len(steps)} points recorded for {STEPS} kernel.log() calls (steps {steps}); "
                "each call must be recorded exactly once"
            )
            assert steps == list(range(STEPS)), f"{key!r}: recorded steps {steps}, logged 0..{STEPS - 1} in order"
            for step, value in series[key]:
                assert math.isclose(value, value_at(step), rel_tol=1e-6, abs_tol=1e-9), (
                    f"{key!r} at step {step}: recorded {value}, logged {value_at(step)}"
                )

    # ---- the suite --------------------------------------------------------------------------------------------

    def test_activates_only_when_asked(self, tmp_path: Path) -> None:
        for log_with, expected in (([], False), ([self.name], True), (["all"], True)):
            kernel = self.kernel(tmp_path, log_with=log_with)
            try:
                trackers = [c for c in kernel.components if c.name == self.name]
                assert bool(trackers) is expected, f"log_with={log_with}: active={trackers}"
                if trackers:
                    assert trackers[0].role == "tracker"
                    assert f"tracker:{self.name}" in trackers[0].provides
            finally:
                kernel.end_training()

    def test_logs_scalars_and_config(self, tmp_path: Path) -> None:
        kernel = self.kernel(tmp_path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._log_steps(kernel, tmp_path, "conformance")
            kernel.end_training()
        assert not [m for m in _accel_warnings(caught) if self.name in m or "tracker" in m]
        self._check_scalars(tmp_path, "conformance")
        config = self.read_config(tmp_path, "conformance")
        for key, value in EXPECTED_CONFIG.items():
            assert key in config, f"hyper-parameter {key!r} not recorded; recorded: {sorted(config)}"
            assert str(config[key]) == value, f"{key}: {config[key]!r} != {value!r}"

    def test_end_training_closes_its_files(self, tmp_path: Path) -> None:
        """After ``end_training()`` the tracker holds no file open under the test's directory (so everything it
        wrote is flushed and complete), and what it wrote reads back once per logged point."""
        kernel = self.kernel(tmp_path)
        self._log_steps(kernel, tmp_path, "closed")
        kernel.end_training()
        still_open = open_files_under(tmp_path)
        assert not still_open, (
            f"after end_training() this process still holds open {still_open}: close (and so flush) the "
            "backend's files in accel_end_training"
        )
        self._check_scalars(tmp_path, "closed")

    def test_get_tracker_unwraps_to_native_run(self, tmp_path: Path) -> None:
        kernel = self.kernel(tmp_path)
        try:
            component = kernel.get_tracker(self.name)
            assert component.role == "tracker"
            kernel.init_trackers("unwrap", init_kwargs=self._init_kwargs(tmp_path))
            run = kernel.get_tracker(self.name, unwrap=True)
            assert run is not None and run is not component
        finally:
            kernel.end_training()

    def test_end_training_without_init_is_quiet(self, tmp_path: Path) -> None:
        kernel = self.kernel(tmp_path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel.end_training()
        assert _accel_warnings(caught) == []

    def test_a_failing_tracker_does_not_stop_this_one(self, tmp_path: Path) -> None:
        broken = BrokenTrackerPlugin()
        kernel = self.kernel(tmp_path, log_with=[self.name, "broken"], extra=[("broken", broken)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._log_steps(kernel, tmp_path, "with-broken")
            kernel.end_training()
        messages = _accel_warnings(caught)
        assert len([m for m in messages if "'broken'" in m]) == 1, messages
        assert broken.component.calls == 1  # skipped after the first failure
        self._check_scalars(tmp_path, "with-broken")

    def test_images_and_tables_if_supported(self, tmp_path: Path) -> None:
        import numpy as np

        kernel = self.kernel(tmp_path)
        hooks = {h for c in kernel.trackers for h in dir(c) if h.startswith("accel_log_")}
        try:
            kernel.init_trackers("media", init_kwargs=self._init_kwargs(tmp_path))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                image = np.zeros((8, 8, 3), dtype=np.uint8)
                image[:4] = 255
                if "accel_log_images" in hooks:
                    kernel.log_images({"sample": image, "batch": [image, image]}, step=0)
                if "accel_log_table" in hooks:
                    kernel.log_table("predictions", columns=["input", "label"], data=[["a", 1], ["b", 0]], step=0)
            assert _accel_warnings(caught) == []
        finally:
            kernel.end_training()
        if not hooks:
            pytest.skip(f"{self.name} logs neither images nor tables")

    @pytest.mark.slow
    @pytest.mark.multiprocess
    def test_two_processes_log_once(self, tmp_path: Path) -> None:
        """``accel launch -n 2``: a main-process-only tracker records one run, with the main process's values."""
        try:
            self.count_runs(tmp_path, "__probe__")
        except NotImplementedError:
            pytest.skip("count_runs is not implemented")
        proc = run_launch(
            [
                "-m",
                "accel.testing.tracker_check",
                self.name,
                str(tmp_path / "project"),
                "two",
                json.dumps(self._init_kwargs(tmp_path)),
            ],
            num_processes=2,
            registered=[self.name, "ddp"],
            home=tmp_path / "accel_home",
            env=self.environment(tmp_path),
            check=False,
        )
        if proc.returncode and "provides 'distributed'" in proc.stderr:
            pytest.skip("no plugin providing 'distributed' (e.g. accel-plugin-ddp) is installed")
        assert proc.returncode == 0, proc.stderr[-4000:]
        scalars = self.read_scalars(tmp_path, "two")
        if self.main_process_only:
            assert self.count_runs(tmp_path, "two") == 1
            assert set(scalars["process_index"].values()) == {0}
        assert sorted(scalars["loss"]) == [0, 1, 2]


class StrategyConformance(_PluginChecks):
    """What a strategy plugin must do: be listed, be chosen with ``--plugin NAME``, and train a model on two
    processes to exactly the weights one process gets with full-batch gradient descent, with working collectives.
    Subclass it and set ``name``; ``launch_args`` adds launch flags, ``tolerance`` loosens the comparison (e.g.
    for a strategy that trains in lower precision)."""

    role = "strategy"
    num_processes: int = 2
    launch_args: tuple[str, ...] = ()
    tolerance: float = 1e-5

    #: False for a strategy that keeps gradients in its own buffers (DeepSpeed's engine): the user's module then
    #: holds none after backward, and the per-micro-batch gradient comparison has nothing to read.
    gradients_visible: bool = True
    #: Seconds the two-process training may take (a backend that compiles ops on first use needs more).
    timeout: float = 240

    def registered(self) -> list[str]:
        """The plugins allowed in the launched run (an ``ACCEL_PLUGINS`` allow-list)."""
        return [self.name]

    def environment(self, tmp_path: Path) -> dict[str, str]:
        """Environment variables the launched processes need (e.g. where a backend builds its ops)."""
        return {}

    def test_dry_run_selects_it(self, tmp_path: Path) -> None:
        script = tmp_path / "train.py"
        script.write_text("print('never run')\n")
        proc = run_launch(
            ["--dry-run", "--plugin", self.name, *self.launch_args, str(script)],
            num_processes=self.num_processes,
            registered=self.registered(),
            home=tmp_path,
        )
        assert f"{self.name} (strategy)" in proc.stdout, proc.stdout

    @pytest.mark.slow
    @pytest.mark.multiprocess
    def test_trains_like_one_process(self, tmp_path: Path) -> None:
        from accel.testing.strategy_check import SAMPLES, make_data, reference_weights

        out = tmp_path / "out"
        run_launch(
            ["--plugin", self.name, *self.launch_args, "-m", "accel.testing.strategy_check", str(out)],
            num_processes=self.num_processes,
            registered=self.registered(),
            home=tmp_path / "home",
            env=self.environment(tmp_path),
            timeout=self.timeout,
        )
        reports = [json.loads((out / f"process{i}.json").read_text()) for i in range(self.num_processes)]
        expected = reference_weights()
        n = self.num_processes
        assert sorted(r["process_index"] for r in reports) == list(range(n))
        for r in reports:
            assert r["num_processes"] == n
            assert r["is_main_process"] == (r["process_index"] == 0)
            assert r["optimizer_steps"] == 3
            assert r["unwrapped_is_original"], (
                f"unwrap_model(prepared) returned a {r['unwrapped_type']}, not the torch.nn.Linear object passed to "
                "prepare(): it must return the user's own module (the kernel keeps it; a strategy's wrapper must "
                "not replace it)"
            )
            assert r["unwrapped_computes_like_prepared"], (
                "unwrap_model(prepared) returned a module that computes differently from the prepared model: the "
                "strategy's wrapper trains its own module, not the user's (a wrapper must hold the user's module "
                "itself, so that unwrap_model, get_state_dict and save_model see the trained weights)"
            )
            assert not _same(r["weights"], r["initial_weights"]), (
                "the module unwrap_model(prepared) returns kept its initial weights through training: the strategy "
                "trains something other than the user's module (a copy inside its own wrapper class?); a wrapper "
                "must hold the user's module itself"
            )
            for got, want in zip(r["weights"], expected, strict=True):
                assert math.isclose(got, want, rel_tol=self.tolerance, abs_tol=self.tolerance), (r["weights"], expected)
            assert len(r["all_weights"]) == n and all(w == r["all_weights"][0] for w in r["all_weights"]), (
                "processes ended with different weights"
            )
            assert len(r["gathered_targets"]) == SAMPLES, "gather_for_metrics must return each sample once"
            for got, want in zip(
                r["gathered_targets"], sorted(float(v) for v in make_data()[1].flatten()), strict=True
            ):
                assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6), "gather_for_metrics lost or mixed samples"
            assert r["reduce_sum"] == n * (n + 1) / 2
            assert r["gather_ranks"] == [float(i + 1) for i in range(n)]
            assert r["broadcast"] == [0.0, 0.0]
        assert reports[0]["state_dict_keys"] == ["bias", "weight"]
        check_gradient_sync(reports, self.gradients_visible)


def _same(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b):
        return False
    return all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-7) for x, y in zip(a, b, strict=True))


def check_gradient_sync(reports: list[dict[str, Any]], gradients_visible: bool = True) -> None:
    """Under ``kernel.accumulate``, each process keeps its own gradients on the micro-batches that do not
    synchronise (they saw other samples, so they differ), and all hold the same gradients after the micro-batch
    that does. Micro-batches where the user's module holds no gradients (kept in a strategy's buffers) are not
    compared; with ``gradients_visible`` at least one must be."""
    n = len(reports)
    flags = [[s["sync"] for s in r["micro_steps"]] for r in reports]
    assert all(f == flags[0] for f in flags), f"processes disagree on sync_gradients: {flags}"
    expected = [(i + 1) % 2 == 0 for i in range(len(flags[0]))]  # strategy_check's ACCUMULATION is 2
    assert flags[0] == expected, f"sync_gradients per micro-batch: {flags[0]}, expected {expected}"
    if n < 2:
        return  # one process: nothing to synchronise with
    compared = 0
    for i, sync in enumerate(flags[0]):
        grads = [r["micro_steps"][i]["grads"] for r in reports]
        if any(g is None for g in grads):
            continue
        compared += 1
        agree = all(_same(g, grads[0]) for g in grads[1:])
        if sync:
            assert agree, f"micro-batch {i} synchronises, yet the {n} processes hold different gradients after it"
        else:
            assert not agree, (
                f"micro-batch {i} does not synchronise (kernel.sync_gradients is False inside accumulate()), yet "
                f"the {n} processes hold identical gradients after it: the strategy synchronised gradients on "
                "every micro-batch; skip the all-reduce while kernel.sync_gradients is False (answer "
                "accel_no_sync, or test kernel.sync_gradients in accel_backward)"
            )
    assert compared or not gradients_visible, (
        "the user's module held no gradients after any backward, so their synchronisation could not be checked; "
        "set gradients_visible = False if the strategy keeps them in its own buffers"
    )
