"""Conformance suites: what every plugin of a role (tracker, strategy, precision, compiler, launcher) must do, as
pytest test classes to subclass.

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
ones that do), each process must see its own share of the data, and ``unwrap_model`` must return the very module
object the user prepared; a precision plugin's autocast must end with the forward, change the compute dtype on the run's device, and let
gradients reach every parameter; a compiler's backend must receive the graphs of the prepared model, and the
compiled model compute and train like the eager one, on the user's own module, its outputs following its inputs; a
launcher (and a strategy's launcher) must honour or refuse every launch setting, and its real launches start the
processes asked, with the plan's environment, restarting them when it honours ``max_restarts``.

Each suite's ``registered()`` is the ``ACCEL_PLUGINS`` allow-list of its runs, and (for the suites that build a
Kernel in the test's process) ``kernel_kwargs()`` the arguments that make the plugin take part.

Why one module of this size: one suite class per role, each a list of behaviour tests with their docstrings, and
a plugin author imports every suite from one module.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from accel import Tracker, hookimpl
from accel.deprecations import kernel_version, release, warn_or_fail
from accel.testing import free_port, imported_modules, make_kernel, patched_environ, run_accel, run_launch

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
        lost = {"loss", "accuracy"} - set(series)
        assert not lost, (
            f"logged values {sorted(lost)} were never recorded (recorded keys: {sorted(series)}): the tracker lost "
            "values; record every key of each kernel.log() call"
        )
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


def written_for(plugin: str) -> tuple[int, int, int] | None:
    """The oldest accel-kernel release the installed plugin ``plugin`` says it works with: the lower bound of its
    distribution's ``accel-kernel`` requirement (``None``: not installed from a distribution, or no lower bound)."""
    from importlib.metadata import entry_points

    from packaging.requirements import Requirement

    for ep in entry_points(group="accel", name=plugin):
        for line in (ep.dist.requires or []) if ep.dist else []:
            req = Requirement(line)
            if req.name == "accel-kernel":
                lows = [release(s.version) for s in req.specifier if s.operator in (">=", "==", "~=", ">")]
                return max(lows) if lows else None
    return None


def added_check(plugin: str, added_in: str, breaking: str, check: Callable[[], None]) -> None:
    """Run ``check``, a check that an existing suite gained in kernel release ``added_in``. For a plugin written for
    an older release (its ``accel-kernel`` requirement starts before ``added_in``) a failure is a ``FutureWarning``
    with the finding until the breaking release ``breaking``, and a failure from then on: the kit gets stricter by
    the same deprecation rule as the contract (docs/plugin-api.md, Stability). Every other plugin fails at once."""
    since = written_for(plugin)
    if since is None or since >= release(added_in) or release(kernel_version()) >= release(breaking):
        check()
        return
    try:
        check()
    except AssertionError as exc:
        # one line, every problem on it: pytest's warnings summary shows only a warning's first line
        finding = " ".join(line.strip() for line in str(exc).strip().splitlines()) or type(exc).__name__
        warnings.warn(
            FutureWarning(
                f"plugin {plugin!r} (written for accel-kernel {'.'.join(map(str, since))}) fails a check the kit "
                f"gained in {added_in}, which fails from {breaking} on: {finding}"
            ),
            stacklevel=2,
        )


class _LaunchSettingsChecks:
    """Every launch setting honoured or refused (:mod:`accel.testing.launch_check`), by whoever answers
    ``accel_launch`` when the plugin is chosen with ``--plugin NAME`` (and ``launch_args``)."""

    name: str = ""
    launch_args: tuple[str, ...] = ()
    #: The kernel release whose suite first ran this check (a suite new in that release: strict from the start).
    launch_check_added_in: str = "0.1.1"

    def registered(self) -> list[str]:
        return [self.name]

    def chosen(self) -> list[str]:
        """The launch flags that choose this plugin."""
        return ["--plugin", self.name, *self.launch_args]

    def test_every_launch_setting_is_honoured_or_refused(self, tmp_path: Path) -> None:
        """One ``accel launch --dry-run`` per launch setting, asking for something: the launcher shows it in its
        command or environment, or refuses it in one line (exit 2) and a real launch starts nothing."""
        from accel.testing.launch_check import Probe, check_launch_settings

        script = tmp_path / "train.py"
        marker = tmp_path / "started"
        script.write_text(f"open({str(marker)!r}, 'a').write('x')\n")

        def launch(flags: Sequence[str], n: int) -> subprocess.CompletedProcess[str]:
            args = ["--quiet", *self.chosen(), *flags, str(script)]
            return run_launch(args, num_processes=n, registered=self.registered(), home=tmp_path, check=False)

        def started(probe: Probe) -> str | None:
            proc = launch(list(probe.flags), probe.num_processes)
            if marker.exists():
                return f"started the script (exit {proc.returncode})"
            return None if proc.returncode == 2 else f"exited with {proc.returncode}, not 2"

        added_check(
            self.name,
            self.launch_check_added_in,
            "0.2.0",
            lambda: check_launch_settings(launch, tmp_path / "kit-logs", free_port(), started),
        )

    #: The process counts the real launches of :meth:`test_a_real_launch_carries_out_the_plan` ask for.
    real_launch_counts: tuple[int, ...] = (1, 3)

    @pytest.mark.multiprocess
    def test_a_real_launch_carries_out_the_plan(self, tmp_path: Path) -> None:
        """Real launches, not dry runs, of a small script: with each of ``real_launch_counts`` (``-n 1``, ``-n 3``)
        exactly that many workers start, ranks 0 to N-1, each with the plan's environment (``ACCEL_CONFIG``); with
        ``--max_restarts 1`` (unless refused) a worker that fails once is started again and the run succeeds; and
        ``num_cpu_threads_per_process``, ``main_process_port`` and ``log_dir`` (unless refused) show in the workers
        (:func:`accel.testing.launch_check.check_real_launches`)."""
        from accel.testing.launch_check import WORKER, check_real_launches

        script = tmp_path / "worker.py"
        script.write_text(WORKER)

        def launch(n: int, flags: Sequence[str], args: Sequence[str]) -> subprocess.CompletedProcess[str]:
            return run_launch(
                ["--quiet", *self.chosen(), *flags, str(script), *args],
                num_processes=n,
                registered=self.registered(),
                home=tmp_path / "home",
                check=False,
                timeout=120,
            )

        added_check(
            self.name,
            self.launch_check_added_in,
            "0.2.0",
            lambda: check_real_launches(launch, tmp_path / "runs", self.real_launch_counts, free_port()),
        )


class StrategyConformance(_LaunchSettingsChecks, _PluginChecks):
    """What a strategy plugin must do: be listed, be chosen with ``--plugin NAME``, honour or refuse every launch
    setting, and train a model on two processes, each on its own share of the data, to exactly the weights one
    process gets with full-batch gradient descent, with working collectives. Subclass it and set ``name``;
    ``launch_args`` adds launch flags, ``tolerance`` loosens the comparison (e.g. for a strategy that trains in
    lower precision)."""

    role = "strategy"
    num_processes: int = 2
    tolerance: float = 1e-5

    #: False for a strategy that keeps gradients in its own buffers (DeepSpeed's engine): the user's module then
    #: holds none after backward, and the per-micro-batch gradient comparison has nothing to read.
    gradients_visible: bool = True
    #: Seconds the two-process training may take (a backend that compiles ops on first use needs more).
    timeout: float = 240
    #: The model strategy_check trains: "linear" (one nn.Linear), or "pipeline" for a strategy that splits layers
    #: into pipeline stages (launch_args giving pp > 1): a four-layer ``layers`` stack trained through
    #: ``model(x, labels=y).loss``, checked as :func:`check_training` describes for pipelines.
    model: str = "linear"

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
        out = tmp_path / "out"
        run_launch(
            [
                "--plugin",
                self.name,
                *self.launch_args,
                "-m",
                "accel.testing.strategy_check",
                str(out),
                *(["--model", self.model] if self.model != "linear" else []),
            ],
            num_processes=self.num_processes,
            registered=self.registered(),
            home=tmp_path / "home",
            env=self.environment(tmp_path),
            timeout=self.timeout,
        )
        reports = [json.loads((out / f"process{i}.json").read_text()) for i in range(self.num_processes)]
        if self.model == "pipeline":
            check_pipeline_training(reports, self.num_processes, self.tolerance)
        else:
            check_training(reports, self.num_processes, self.tolerance, self.gradients_visible)


def check_sharding(reports: list[dict[str, Any]], samples: int) -> None:
    """In an epoch, each of the processes trains on its own share of the samples, and together on all of them."""
    n = len(reports)
    seen = [sorted(r["epoch_targets"]) for r in reports]
    if n > 1 and all(s == seen[0] for s in seen):
        raise AssertionError(
            f"the data was not sharded across processes: each of the {n} processes trained on the same "
            f"{len(seen[0])} samples in an epoch (of {samples}), instead of its own 1/{n} share; let the kernel "
            "prepare dataloaders (accel_prepare_dataloader's default) or shard them with accel.spi.shard_dataloader"
        )
    counts = [len(s) for s in seen]
    assert counts == [samples // n] * n, (
        f"the processes trained on {counts} samples in an epoch; with {samples} samples each of the {n} must get "
        f"{samples // n}: the data was not sharded evenly across processes"
    )
    together = {v for s in seen for v in s}
    assert len(together) == samples, (
        f"the processes' shares overlap or miss samples: {len(together)} different samples of {samples} in an "
        "epoch; each sample must go to exactly one process"
    )


def check_training(reports: list[dict[str, Any]], n: int, tolerance: float, gradients_visible: bool) -> None:
    """The reports of ``accel.testing.strategy_check`` from ``n`` processes: sharded data, the weights of
    full-batch gradient descent everywhere, working collectives, gradients synchronised on sync steps only."""
    from accel.testing.strategy_check import SAMPLES, reference_weights

    expected = reference_weights()
    assert sorted(r["process_index"] for r in reports) == list(range(n))
    check_sharding(reports, SAMPLES)
    for r in reports:
        assert r["num_processes"] == n
        assert r["is_main_process"] == (r["process_index"] == 0)
        assert r["optimizer_steps"] == 3, f"{r['optimizer_steps']} optimizer steps, expected 3 (one per epoch)"
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
            assert math.isclose(got, want, rel_tol=tolerance, abs_tol=tolerance), (r["weights"], expected)
        assert len(r["all_weights"]) == n and all(w == r["all_weights"][0] for w in r["all_weights"]), (
            "processes ended with different weights"
        )
        check_collectives(r, n)
    assert reports[0]["state_dict_keys"] == ["bias", "weight"]
    check_gradient_sync(reports, gradients_visible)


def check_collectives(r: dict[str, Any], n: int) -> None:
    """One process's report: gather_for_metrics gave each sample once; reduce, gather and broadcast over all ``n``."""
    from accel.testing.strategy_check import SAMPLES, make_data

    assert len(r["gathered_targets"]) == SAMPLES, "gather_for_metrics must return each sample once"
    for got, want in zip(r["gathered_targets"], sorted(float(v) for v in make_data()[1].flatten()), strict=True):
        assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6), "gather_for_metrics lost or mixed samples"
    assert r["reduce_sum"] == n * (n + 1) / 2
    assert r["gather_ranks"] == [float(i + 1) for i in range(n)]
    assert r["broadcast"] == [0.0, 0.0]


def check_pipeline_training(reports: list[dict[str, Any]], n: int, tolerance: float) -> None:
    """:func:`check_training` for a strategy running ``strategy_check --model pipeline`` with pp > 1 (see
    docs/design.md, "The conformance kit under pipeline parallelism"): the processes of one pipeline read the same
    batches, so the data is sharded over the ``data_parallel_size`` shards; each process holds the parameters of
    its stage(s) only, so the weights are checked by name against full-batch gradient descent, the processes
    holding a parameter must agree on it, and together they must hold all of them; gradients are compared between
    the processes holding the same parameters (the data-parallel replicas of a stage): they must agree after the
    micro-batches that synchronise; on the others they may agree too, since torch's ``PipelineStage`` reduces a
    stage's gradients over the data-parallel group at the end of every schedule step (one micro-batch here), and a
    sharded (FSDP2) gradient gathered whole is one tensor on every replica."""
    from accel.testing.strategy_check import SAMPLES, reference_state

    expected = reference_state("pipeline")
    assert sorted(r["process_index"] for r in reports) == list(range(n))
    dp = reports[0]["data_parallel_size"]
    assert dp < n, f"data_parallel_size {dp} with {n} processes: the strategy did not build a pipeline (pp > 1)"
    shares: dict[str, dict[str, Any]] = {}  # one report per distinct data shard
    for r in reports:
        shares.setdefault(json.dumps(sorted(r["epoch_targets"])), r)
    assert len(shares) == dp, (
        f"the {n} processes trained on {len(shares)} different shares of the data, expected one per data-parallel "
        f"shard ({dp}): the processes of one pipeline must read the same batches"
    )
    check_sharding(list(shares.values()), SAMPLES)
    held: dict[str, list[float]] = {}
    for r in reports:
        assert r["num_processes"] == n and r["is_main_process"] == (r["process_index"] == 0)
        assert r["optimizer_steps"] == 3, f"{r['optimizer_steps']} optimizer steps, expected 3 (one per epoch)"
        assert r["unwrapped_is_original"], (
            f"unwrap_model(prepared) returned a {r['unwrapped_type']}, not the module passed to prepare() (pruned "
            "in place to this process's stages)"
        )
        for name, got in r["named_weights"].items():
            assert name in expected, f"process {r['process_index']} holds {name!r}, not a parameter of the model"
            assert not _same(got, r["initial_named_weights"][name]), (
                f"{name!r} kept its initial weights through training on process {r['process_index']}: the "
                "pipeline's gradients did not reach the user's module, or the optimizer did not step it"
            )
            for g, w in zip(got, expected[name], strict=True):
                assert math.isclose(g, w, rel_tol=tolerance, abs_tol=tolerance), (name, got, expected[name])
            assert _same(held.setdefault(name, got), got), f"processes holding {name!r} ended with different values"
        check_collectives(r, n)
    assert sorted(held) == sorted(expected), f"the processes together hold {sorted(held)}, not {sorted(expected)}"
    assert sorted(reports[0]["state_dict_keys"]) == sorted(expected), reports[0]["state_dict_keys"]
    stages: dict[tuple[str, ...], list[dict[str, Any]]] = {}  # the data-parallel replicas of each stage
    for r in reports:
        stages.setdefault(tuple(r["named_weights"]), []).append(r)
    for replicas in stages.values():
        for i, step in enumerate(replicas[0]["micro_steps"]):
            assert step["grads"] is not None, (
                f"after micro-batch {i}'s pipeline step the user's module held no gradients: the pipeline's "
                "backward must leave them in the stage's parameters"
            )
        check_gradient_sync(replicas, unsynced_may_agree=True)


def _same(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b):
        return False
    return all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-7) for x, y in zip(a, b, strict=True))


def check_gradient_sync(
    reports: list[dict[str, Any]], gradients_visible: bool = True, unsynced_may_agree: bool = False
) -> None:
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
        elif not unsynced_may_agree:
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


class _InProcessChecks(_PluginChecks):
    """Suites that build a Kernel in the test's own process, with a private ``ACCEL_HOME``."""

    def registered(self) -> list[str]:
        """The entry-point plugins registered in the Kernel (an ``ACCEL_PLUGINS`` allow-list)."""
        return [self.name]

    def kernel_kwargs(self) -> dict[str, Any]:
        """The ``Kernel(...)`` arguments that make this plugin take part."""
        return {"plugins": [self.name]}

    def kernel(self) -> Any:
        return make_kernel(self.registered(), **self.kernel_kwargs())

    @pytest.fixture(autouse=True)
    def _accel_home(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        home = tmp_path / "accel_home"
        home.mkdir(exist_ok=True)
        monkeypatch.setenv("ACCEL_HOME", str(home))

    def _component(self, kernel: Any) -> Any:
        found = [c for c in kernel.components if c.name == self.name]
        assert found, f"plugin {self.name!r} does not take part with Kernel(**{self.kernel_kwargs()!r})"
        assert found[0].role == self.role, f"plugin {self.name!r} takes part as {found[0].role!r}, not {self.role!r}"
        return found[0]


class PrecisionConformance(_InProcessChecks):
    """What a precision plugin must do: take part for its mode, run the forward of prepared models (and nothing
    else) under its autocast, which computes in ``compute_dtype`` (by default: anything but float32) on the run's
    device, let gradients reach every trainable parameter with the values float32 gives (within
    ``tolerance``, relative), and save and load its state (a loss scale) with checkpoints. Subclass it and set
    ``name`` and ``mode`` (the ``mixed_precision`` value it provides); the kernels are built with
    ``kernel_kwargs()``, by default ``{"mixed_precision": mode}``."""

    role = "precision"
    mode: str = ""
    tolerance: float = 1e-2
    #: The dtype (its torch name: "float16", "bfloat16") a linear layer of a prepared model computes in under the
    #: mode, on the device of the run; ``None``: any dtype but float32 (the mode must change the compute dtype).
    compute_dtype: str | None = None

    def _check_compute_dtype(self, device: str, seen: Any, torch_said: Sequence[str] = ()) -> None:
        """The forward of a prepared model computed in the mode's dtype on the run's device (not float32);
        ``torch_said``: torch's warnings about autocast in that forward, shown as the plugin's."""
        import torch

        wanted = getattr(torch, self.compute_dtype) if self.compute_dtype else None
        if seen == wanted or (wanted is None and seen != torch.float32):
            return
        raise AssertionError(
            f"mixed_precision={self.mode!r} did not change the compute dtype on the run's device ({device!r}): the "
            f"prepared model's first linear layer computed in {seen}"
            + (f", not {wanted}" if wanted is not None else "")
            + f". The autocast plugin {self.name!r} makes must be for the device the run uses (torch.autocast("
            "kernel.device.type, ...)); an autocast for another device type (a hard-coded 'cuda') casts nothing here"
            + "".join(f". torch warned, in the plugin's autocast: {said!r}" for said in torch_said)
        )

    def kernel_kwargs(self) -> dict[str, Any]:
        return {"mixed_precision": self.mode}

    @pytest.fixture(autouse=True)
    def _restore_autocast(self) -> Iterator[None]:
        """A plugin that leaves autocast on must not leave it on for the tests after this one."""
        from accel.testing.model_check import autocast_state, restore_autocast

        states = {device: autocast_state(device) for device in ("cpu", "cuda")}
        yield
        for device, state in states.items():
            restore_autocast(device, state)

    def test_takes_part_for_its_mode(self) -> None:
        kernel = self.kernel()
        try:
            component = self._component(kernel)
            assert f"precision:{self.mode}" in component.provides, (
                f"the precision component does not declare 'precision:{self.mode}' in provides: {component.provides}"
            )
        finally:
            kernel.end_training()

    def test_autocast_is_scoped_to_the_forward(self) -> None:
        """Autocast is on inside the forward of a prepared model (as ``kernel.autocast()`` has it) and off
        everywhere else: after ``Kernel()``, after the forward returns, for the loss, backward and the step."""
        import torch

        from accel.testing.model_check import Probe, data, loss_of, prepared

        kernel = self.kernel()
        try:
            device = kernel.device.type
            on = []  # the places where autocast is on, outside any forward
            if torch.is_autocast_enabled(device):
                on.append("after Kernel() returned")
            model, optimizer, _ = prepared(kernel, Probe())
            x, y = data(kernel.device)
            with warnings.catch_warnings(record=True) as caught:  # torch's "... Disabling autocast" names the plugin
                warnings.simplefilter("always")
                output = model(x)
            if torch.is_autocast_enabled(device):
                on.append("after the prepared model's forward returned")
            loss = loss_of(output, y)
            if loss.dtype != torch.float32:
                on.append(f"for the loss (computed in {loss.dtype})")
            kernel.backward(loss)
            if torch.is_autocast_enabled(device):
                on.append("after kernel.backward(loss)")
            optimizer.step()
            optimizer.zero_grad()
            if torch.is_autocast_enabled(device):
                on.append("after optimizer.step()")
            assert not on, (
                f"autocast leaks outside the forward: it is on {'; '.join(on)}. The precision plugin must turn "
                "autocast on only in the context its accel_autocast factory makes (the kernel enters it around each "
                "forward and leaves it when the forward returns), never for the whole process "
                "(torch.autocast(...).__enter__() without __exit__, torch.set_autocast_enabled)"
            )
            inside = kernel.unwrap_model(model).seen[0]
            with kernel.autocast():
                expected = (torch.is_autocast_enabled(device), torch.nn.functional.linear(x, x[:1]).dtype)
            assert inside == expected, (
                f"the prepared model's forward ran with autocast on={inside[0]} computing in {inside[1]}, while "
                f"kernel.autocast() gives on={expected[0]} computing in {expected[1]}: the forward of prepared models "
                "must run under the plugin's autocast"
            )
            torch_said = [str(w.message) for w in caught if "autocast" in str(w.message).lower()]
            for w in caught:  # the others, as they were
                if str(w.message) not in torch_said:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            self._check_compute_dtype(device, inside[1], torch_said)
        finally:
            kernel.end_training()

    def test_gradients_reach_every_parameter(self) -> None:
        """After ``kernel.backward(loss)`` (and ``unscale_gradients``) every trainable parameter of the user's
        module holds the gradient float32 gives, within ``tolerance``; the optimizer step then changes it."""
        import torch

        from accel.testing.model_check import Probe, data, loss_of, prepared, relative_error

        kernel = self.kernel()
        try:
            net = Probe()
            model, optimizer, reference = prepared(kernel, net)
            x, y = data(kernel.device)
            kernel.backward(loss_of(model(x), y))
            kernel.unscale_gradients()
            loss_of(reference(x), y).backward()
            params = dict(net.named_parameters())
            missing = [name for name, p in params.items() if p.requires_grad and p.grad is None]
            assert not missing, (
                f"no gradient reached {missing} after kernel.backward(loss): the precision plugin drops gradients "
                "(run backward of the loss it was given, scaled if need be, through the graph of the forward)"
            )
            for name, ref in reference.named_parameters():
                grad = params[name].grad
                assert grad is not None and ref.grad is not None
                error = relative_error(grad, ref.grad)
                assert torch.isfinite(grad).all() and error <= self.tolerance, (
                    f"the gradient of {name!r} differs from float32's by {error:.3g} (relative; tolerance "
                    f"{self.tolerance}): the plugin's gradients are not the loss's (left scaled? scaled twice? "
                    "lost in a low-precision copy?)"
                )
            before = {name: p.detach().clone() for name, p in params.items()}
            optimizer.step()
            unchanged = [name for name, p in params.items() if torch.equal(p.detach(), before[name])]
            assert not unchanged, f"optimizer.step() left {unchanged} unchanged: the step did not reach them"
        finally:
            kernel.end_training()

    def test_state_round_trips_through_checkpoints(self, tmp_path: Path) -> None:
        """The plugin's checkpoint items (``accel_state_items``: a loss scale...) come back from ``load_state`` in
        a new Kernel as they were saved. The run includes a step whose loss is infinite, so a dynamic loss scale
        differs from a fresh one."""
        from accel.testing.model_check import Probe, data, loss_of, prepared, state_difference

        saved = self._train_and_save(tmp_path / "checkpoint")
        kernel = self.kernel()
        try:
            model, optimizer, _ = prepared(kernel, Probe())
            fresh = self._plugin_state(kernel)
            kernel.load_state(tmp_path / "checkpoint")
            loaded = self._plugin_state(kernel)
            assert loaded.keys() == saved.keys(), f"checkpoint items {sorted(saved)} saved, {sorted(loaded)} loaded"
            for key, state in saved.items():
                differs = state_difference(state, loaded[key])
                untouched = state_difference(fresh[key], loaded[key]) is None
                assert differs is None, (
                    f"checkpoint item {key!r} of plugin {self.name!r} came back from load_state unlike it was saved "
                    f"(saved against loaded): {differs}"
                    + (" (loaded as a new Kernel starts it: nothing was restored)" if untouched else "")
                    + "; the plugin's load_state_dict must restore what its state_dict returned"
                )
            x, y = data(kernel.device)
            kernel.backward(loss_of(model(x), y))  # training goes on after loading
            optimizer.step()
        finally:
            kernel.end_training()

    def _train_and_save(self, directory: Path) -> dict[str, Any]:
        from accel.testing.model_check import Probe, data, loss_of, prepared

        kernel = self.kernel()
        try:
            model, optimizer, _ = prepared(kernel, Probe())
            x, y = data(kernel.device)
            for factor in (1.0, float("inf"), 1.0):
                kernel.backward(loss_of(model(x), y) * factor)
                optimizer.step()
                optimizer.zero_grad()
            state = self._plugin_state(kernel)
            kernel.save_state(directory)
            return state
        finally:
            kernel.end_training()

    def _plugin_state(self, kernel: Any) -> dict[str, Any]:
        """``{key: deep copy of state_dict()}`` of the checkpoint items this plugin gives."""
        import copy

        from accel.checkpoint.items import collect_items

        return {
            key: copy.deepcopy(item.obj.state_dict())
            for key, item in collect_items(kernel).items()
            if item.provider == self.name
        }


class CompilerConformance(_InProcessChecks):
    """What a compiler plugin must do: take part for its backend, and compile in place, so that graphs of the
    prepared model reach a ``torch.compile`` backend in its forward, and the prepared model computes what the eager
    model computes (on a second batch too: outputs follow inputs), with the same gradients (its output requires
    grad), and training it trains the user's module (``unwrap_model`` returns that module; its state dict keys do
    not change). Subclass it and set ``name`` and
    ``backend`` (the ``dynamo_backend`` value it answers); the kernels are built with ``kernel_kwargs()``, by
    default ``{"dynamo_backend": backend}``."""

    role = "compiler"
    backend: str = ""
    tolerance: float = 1e-5

    def kernel_kwargs(self) -> dict[str, Any]:
        return {"dynamo_backend": self.backend}

    @pytest.fixture(autouse=True)
    def _fresh_compile_caches(self) -> Iterator[None]:
        """Every test compiles anew (dynamo's caches would otherwise hold the previous test's code)."""
        import torch._dynamo

        torch._dynamo.reset()
        yield
        torch._dynamo.reset()

    def test_takes_part_for_its_backend(self) -> None:
        kernel = self.kernel()
        try:
            component = self._component(kernel)
            backend = str(kernel.settings.get("dynamo_backend") or "no")
            wanted = {"compile", f"compile:{backend}"}
            assert wanted & set(component.provides), (
                f"the compiler does not provide 'compile' or 'compile:{backend}': {sorted(component.provides)}"
            )
        finally:
            kernel.end_training()

    def test_compiled_model_computes_and_trains_like_the_eager_one(self) -> None:
        import torch

        from accel.testing.model_check import LR, Net, compiled_graphs, data, loss_of, prepared, relative_error

        kernel = self.kernel()
        try:
            net = Net()
            keys = list(net.state_dict())
            model, optimizer, reference = prepared(kernel, net)
            unwrapped = kernel.unwrap_model(model)
            assert unwrapped is net, (
                f"unwrap_model(prepared) returned a {type(unwrapped).__name__}, not the module passed to prepare(): "
                "compile in place (accel_transform_model), so that the user's module stays the module"
            )
            x, y = data(kernel.device)
            graphs = compiled_graphs()
            output = model(x)
            assert compiled_graphs() > graphs, (
                f"plugin {self.name!r} compiled nothing: the prepared model's forward ran eagerly, no graph of it "
                "reached a torch.compile backend. accel_transform_model must compile the model in place "
                "(model.compile(backend=...)); its return value is ignored, so returning torch.compile(model) "
                "compiles a model nobody calls"
            )
            expected = reference(x)
            error = relative_error(output, expected)
            assert error <= self.tolerance, f"the compiled model's outputs differ from the eager model's by {error:.3g}"
            assert output.requires_grad, (
                f"the output of the model plugin {self.name!r} compiled does not require grad (the eager model's "
                "does): the compiled code cut the autograd graph, so training cannot reach the parameters (a backend "
                "running the graph under torch.no_grad() or inference_mode, or returning detached tensors?); the "
                "compiled forward must keep autograd as the eager one does"
            )
            self._outputs_follow_the_inputs(model, reference, output)
            kernel.backward(loss_of(output, y))
            loss_of(expected, y).backward()
            params = dict(net.named_parameters())
            missing = [name for name, p in params.items() if p.grad is None]
            assert not missing, (
                f"after kernel.backward(loss) the user's module holds no gradient for {missing}: what the prepared "
                "model computes with is not the user's module (a copy of the model?); compile in place "
                "(accel_transform_model, module.compile(...)) so that training the prepared model trains it"
            )
            for name, ref in reference.named_parameters():
                grad = params[name].grad
                assert grad is not None and ref.grad is not None
                error = relative_error(grad, ref.grad)
                assert error <= self.tolerance, f"the gradient of {name!r} differs from the eager one's by {error:.3g}"
            optimizer.step()
            with torch.no_grad():
                for name, ref in reference.named_parameters():
                    assert ref.grad is not None
                    error = relative_error(params[name], ref - LR * ref.grad)
                    assert error <= self.tolerance, (
                        f"after optimizer.step() the user's {name!r} is not what one SGD step gives ({error:.3g} off)"
                    )
            after = list(kernel.get_state_dict(model))
            assert after == keys, (
                f"compiling changed the model's state dict keys from {keys} to {after}: checkpoints and save_model "
                "must keep the user's names (compile in place, no wrapper in the module tree)"
            )
        finally:
            kernel.end_training()

    def _outputs_follow_the_inputs(self, model: Any, reference: Any, first: Any) -> None:
        """A second batch of the same shapes (the compiled code is reused, not recompiled) gives the eager model's
        output for that batch, not the first batch's."""
        import torch

        from accel.testing.model_check import data, relative_error

        x2, _ = data(first.device, seed=2)
        second = model(x2).detach()  # with grad on, as the first call: grad mode is one of dynamo's guards
        with torch.no_grad():
            expected = reference(x2)
        error = relative_error(second, expected)
        if error <= self.tolerance:
            return
        stale = relative_error(second, first) <= self.tolerance
        assert not stale, (
            f"the model plugin {self.name!r} compiled returned the first batch's output for a second, different "
            "batch: its outputs do not follow its inputs (does the backend's compiled function run the graph on the "
            "example_inputs it was given at compile time instead of the arguments of each call?)"
        )
        raise AssertionError(
            f"on a second batch the compiled model's outputs differ from the eager model's by {error:.3g} "
            f"(tolerance {self.tolerance}; the first batch agreed): the compiled code does not compute from each "
            "call's inputs"
        )


class LauncherConformance(_LaunchSettingsChecks, _PluginChecks):
    """What a launcher plugin (a component that answers ``accel_launch`` and nothing else of training) must do:
    answer ``accel_launch`` when chosen with ``--plugin NAME``, honour or refuse every launch setting (dry runs),
    start as many workers as asked with the plan's environment and carry out ``max_restarts`` (real launches), and
    start workers that train together (two processes through the strategy that takes part: accel-plugin-ddp by
    default). Subclass it and set ``name``; override ``registered()`` to train through another strategy."""

    role = "launcher"
    num_processes: int = 2
    timeout: float = 240

    def registered(self) -> list[str]:
        return [self.name, "ddp"]

    def test_dry_run_launches_with_it(self, tmp_path: Path) -> None:
        script = tmp_path / "train.py"
        script.write_text("print('never run')\n")
        proc = run_launch(
            ["--dry-run", "--verbose", *self.chosen(), str(script)],  # the hook table is behind --verbose
            num_processes=self.num_processes,
            registered=self.registered(),
            home=tmp_path,
        )
        answer = re.search(r"^  accel_launch: (\S+)", proc.stdout, re.M)
        assert answer is not None and answer.group(1).split(":")[0] == self.name, (
            f"with --plugin {self.name}, accel_launch is answered by {answer and answer.group(1)}: a launcher "
            "answers before the strategy (@hookimpl(tryfirst=True))"
        )

    @pytest.mark.slow
    @pytest.mark.multiprocess
    def test_workers_train_together(self, tmp_path: Path) -> None:
        """The workers it starts form one run: they train like the strategy suite's two processes."""
        out = tmp_path / "out"
        run_launch(
            [*self.chosen(), "-m", "accel.testing.strategy_check", str(out)],
            num_processes=self.num_processes,
            registered=self.registered(),
            home=tmp_path / "home",
            timeout=self.timeout,
        )
        reports = [json.loads((out / f"process{i}.json").read_text()) for i in range(self.num_processes)]
        check_training(reports, self.num_processes, 1e-5, True)
