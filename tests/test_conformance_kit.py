"""The conformance kit (accel.testing.conformance) against mutants of the new-plugin templates: a planted bug for
every role (tracker, strategy, precision, compiler, launcher).

Each mutant is a real plugin: the files ``accel new-plugin`` writes, changed in one place, and made discoverable
the way an installed plugin is (a distribution with an ``accel`` entry point on ``sys.path`` / ``PYTHONPATH``,
selected by the kit's ``ACCEL_PLUGINS`` allow-list). The kit must fail each with a message naming the fault. The
unchanged templates pass the same suites (tests/test_tracker_jsonl.py runs plugins/jsonl, the tracker template's
output; tests/test_plugin_template.py installs and tests both templates).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from accel.commands.new_plugin import render

Edits = tuple[str, str] | list[tuple[str, str]]


def install(site: Path, name: str, kind: str, changes: dict[str, Edits]) -> Any:
    """Write the template's package for plugin ``name`` into ``site``, with ``changes`` (``{file: (old, new)}`` or
    ``{file: [(old, new), ...]}``, each ``old`` found exactly once), and a distribution whose ``accel`` entry point
    names it. Returns an instance of the conformance class of the template's own tests (``tests/test_NAME.py``,
    unchanged)."""
    applied = set()
    files = render(name, kind)
    for path, text in files.items():
        if not path.startswith("src/"):
            continue
        file = path.removeprefix("src/")
        base = Path(file).name
        if base in changes:
            edits = changes[base]
            for old, new in edits if isinstance(edits, list) else [edits]:
                assert text.count(old) == 1, f"the template's {base} changed: update this mutant ({old!r})"
                text = text.replace(old, new)
            applied.add(base)
        (site / file).parent.mkdir(parents=True, exist_ok=True)
        (site / file).write_text(text, encoding="utf-8")
    assert applied == set(changes), f"no template file {sorted(set(changes) - applied)}"
    meta = site / f"accel_plugin_{name}-0.1.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: accel-plugin-{name}\nVersion: 0.1.0\n")
    (meta / "entry_points.txt").write_text(f"[accel]\n{name} = accel_{name}\n")
    tests = site.parent / f"test_{name}.py"
    tests.write_text(files[f"tests/test_{name}.py"], encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"tests_of_{name}", tests)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    title = "".join(part.capitalize() for part in name.split("_"))
    return getattr(module, f"Test{title}Conformance")()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on this process's ``sys.path`` and on its subprocesses' ``PYTHONPATH``."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    yield site
    for module in [m for m in sys.modules if m.startswith(("accel_mut", "tests_of_mut"))]:
        del sys.modules[module]
    importlib.invalidate_caches()


# ---- trackers: the JSON-lines template ------------------------------------------------------------------------

TRACKER = "tracker.py"
LOG_LINE = '        self._write({"event": "log", "step": step, "values": _plain(values)})\n'
CLOSE_LINES = "            self.run.close()\n            self.run = None\n"


@pytest.fixture
def accel_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What the tracker suite's autouse fixture does when pytest runs it: a private ACCEL_HOME."""
    home = tmp_path / "accel_home"
    monkeypatch.setenv("ACCEL_HOME", str(home))
    return home


def test_a_tracker_writing_every_row_twice_fails(site: Path, tmp_path: Path, accel_home: Path) -> None:
    suite = install(site, "mut_twice", "tracker", {TRACKER: (LOG_LINE, LOG_LINE * 2)})
    with pytest.raises(AssertionError, match=r"10 points recorded for 5 kernel.log\(\) calls.*exactly once"):
        suite.test_logs_scalars_and_config(tmp_path)


def test_a_tracker_never_closing_its_file_fails(site: Path, tmp_path: Path, accel_home: Path) -> None:
    suite = install(site, "mut_open", "tracker", {TRACKER: (CLOSE_LINES, "            pass\n")})
    with pytest.raises(
        AssertionError,
        match=r"after end_training\(\) this process still holds open "
        r"\['project/mut_open/closed.jsonl'\]",
    ):
        suite.test_end_training_closes_its_files(tmp_path)


def test_a_tracker_losing_values_fails(site: Path, tmp_path: Path, accel_home: Path) -> None:
    first_only = LOG_LINE.replace("_plain(values)", "_plain(dict(list(values.items())[:1]))")
    suite = install(site, "mut_lose", "tracker", {TRACKER: (LOG_LINE, first_only)})
    with pytest.raises(
        AssertionError, match=r"logged values \['accuracy'\] were never recorded .* the tracker lost values"
    ):
        suite.test_logs_scalars_and_config(tmp_path)


def test_the_unchanged_tracker_template_passes_the_new_checks(site: Path, tmp_path: Path, accel_home: Path) -> None:
    """The same checks, the same installation, no mutation: they pass (so the failures above are the mutations')."""
    suite = install(site, "mut_none", "tracker", {})
    suite.test_logs_scalars_and_config(tmp_path / "a")
    suite.test_end_training_closes_its_files(tmp_path / "b")


# ---- strategies: the gradient-averaging template (two real processes) -----------------------------------------

STRATEGY = "strategy.py"
SYNC_LINE = "        if kernel.sync_gradients and kernel.num_processes > 1:\n"
WRAP_RETURN = "            self.models.append(model)\n        return list(models), list(optimizers), list(schedulers)\n"
OWN_WRAPPER = '''        import copy

        import torch

        class AvgdpModule(torch.nn.Module):
            """The strategy's own wrapper class, holding its own copy of the user's module."""

            def __init__(self, inner: torch.nn.Module) -> None:
                super().__init__()
                self.inner = copy.deepcopy(inner)

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return self.inner(*args, **kwargs)

        wrappers = [AvgdpModule(model) for model in models]
        self.models.extend(wrappers)
        return wrappers, list(optimizers), list(schedulers)
'''


NO_SHARDING = """            self.models.append(model)
        return list(models), list(optimizers), list(schedulers)

    @hookimpl
    def accel_prepare_dataloader(self, dataloader: Any) -> Any:
        return dataloader  # every process iterates over the whole data set
"""


MUTANTS = {
    "mut_sync": {STRATEGY: (SYNC_LINE, "        if kernel.num_processes > 1:\n")},
    "mut_wrap": {STRATEGY: (WRAP_RETURN, OWN_WRAPPER)},
    "mut_shard": {STRATEGY: (WRAP_RETURN, NO_SHARDING)},
}


@pytest.fixture(scope="module")
def strategy_failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Both strategy mutants through the kit's two-process training test, launched side by side (each is a
    separate `accel launch`; together they take the time of about one): ``{name: the kit's failure message}``."""
    root = tmp_path_factory.mktemp("strategy_mutants")
    site = root / "site"
    site.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        suites = {name: install(site, name, "strategy", changes) for name, changes in MUTANTS.items()}

        def run(name: str) -> str:
            try:
                suites[name].test_trains_like_one_process(root / name)
            except AssertionError as exc:
                return str(exc)
            return "passed"

        with ThreadPoolExecutor(len(suites)) as pool:
            return dict(zip(suites, pool.map(run, suites), strict=True))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("mutant", "message"),
    [
        # Averaging gradients after every backward gives the same weights as syncing once per step (the average is
        # linear): only the gradients between synchronisations show that it talked on every micro-batch.
        (
            "mut_sync",
            r"micro-batch 0 does not synchronise .* identical gradients after it: "
            r"the strategy synchronised gradients on every micro-batch",
        ),
        # Its wrapper trains a copy: the module unwrap_model returns (the user's) never learns.
        ("mut_wrap", r"the module unwrap_model\(prepared\) returns kept its initial weights through training"),
        # Every process trains on all the data: said so, not as a wrong step count.
        (
            "mut_shard",
            r"the data was not sharded across processes: each of the 2 processes trained on the same 32 samples",
        ),
    ],
    ids=["syncs-every-micro-batch", "trains-its-own-copy", "does-not-shard-data"],
)
def test_a_faulty_strategy_fails_naming_the_fault(strategy_failures: dict[str, str], mutant: str, message: str) -> None:
    assert re.search(message, strategy_failures[mutant]), strategy_failures[mutant]


# ---- launchers (and a strategy's launcher): settings silently dropped ------------------------------------------

DROPPED = ("max_restarts", "tee", "log_dir", "main_process_port")
STRATEGY_DROPS = [
    ('    "tee",\n    "log_dir",\n', ""),
    ("f\"--master_port={settings['main_process_port'] or free_port()}\",", 'f"--master_port={free_port()}",'),
    ("            f\"--max_restarts={settings['max_restarts']}\",\n", ""),
]
LAUNCHER_DROPS = [
    ('    "max_restarts",\n', ""),
    ('    "tee",\n', ""),
    ('MASTER_PORT=str(settings["main_process_port"] or free_port()),', "MASTER_PORT=str(free_port()),"),
    ('log_dir = settings["log_dir"]', "log_dir = None"),
]


@pytest.mark.parametrize(
    ("kind", "changes"),
    [("strategy", {STRATEGY: STRATEGY_DROPS}), ("launcher", {"launcher.py": LAUNCHER_DROPS})],
    ids=["strategy", "launcher"],
)
def test_a_launcher_dropping_settings_fails(site: Path, tmp_path: Path, kind: str, changes: dict[str, Edits]) -> None:
    """``--max_restarts --tee --log_dir --main_process_port`` accepted and silently not carried out: each named."""
    suite = install(site, f"mut_drop_{kind}", kind, changes)
    with pytest.raises(AssertionError) as failed:
        suite.test_every_launch_setting_is_honoured_or_refused(tmp_path)
    for setting in DROPPED:
        assert f"- {setting} was neither honoured nor refused" in str(failed.value), str(failed.value)
    assert str(failed.value).count(" was neither honoured nor refused") == len(DROPPED), str(failed.value)
    first = str(failed.value).splitlines()[0]  # every ignored setting named on the first line
    assert first.startswith("launch settings the launcher ignores: ") and set(first.split(": ")[1].split(", ")) == set(
        DROPPED
    ), first


@pytest.mark.parametrize("kind", ["strategy", "launcher"])
def test_the_unchanged_launchers_pass_the_launch_settings_check(site: Path, tmp_path: Path, kind: str) -> None:
    install(site, f"mut_keep_{kind}", kind, {}).test_every_launch_setting_is_honoured_or_refused(tmp_path)


# ---- precision: the float16 + loss-scale template ---------------------------------------------------------------

PRECISION = "precision.py"
SCALER_LINE = "        self.scaler = torch.amp.GradScaler(device)\n"
LEAK = (
    SCALER_LINE + "        torch.autocast(device, dtype=torch.float16).__enter__()  # never left: on for the process\n"
)
BACKWARD_LINE = "        self.scaler.scale(kernel.scale_for_accumulation(loss)).backward(**backward_kwargs)\n"
NO_BACKWARD = "        self.scaler.scale(kernel.scale_for_accumulation(loss))  # backward never runs\n"


@pytest.fixture
def autocast_kept() -> Any:
    """What the precision suite's own fixture does: autocast as it was after the test, whatever the plugin left."""
    from accel.testing.model_check import autocast_state, restore_autocast

    state = autocast_state("cpu")
    yield
    restore_autocast("cpu", state)


def test_a_precision_autocast_leaking_outside_the_forward_fails(
    site: Path, accel_home: Path, autocast_kept: None
) -> None:
    suite = install(site, "mut_leak", "precision", {PRECISION: (SCALER_LINE, LEAK)})
    with pytest.raises(
        AssertionError,
        match=r"autocast leaks outside the forward: it is on after Kernel\(\) returned; after the prepared "
        r"model's forward returned; after kernel.backward\(loss\); after optimizer.step\(\)",
    ):
        suite.test_autocast_is_scoped_to_the_forward()


def test_a_precision_dropping_gradients_fails(site: Path, accel_home: Path, autocast_kept: None) -> None:
    suite = install(site, "mut_nograd", "precision", {PRECISION: (BACKWARD_LINE, NO_BACKWARD)})
    with pytest.raises(
        AssertionError,
        match=r"no gradient reached \['hidden.weight', 'hidden.bias', 'out.weight', 'out.bias'\] after "
        r"kernel.backward\(loss\): the precision plugin drops gradients",
    ):
        suite.test_gradients_reach_every_parameter()


def test_the_unchanged_precision_template_passes_the_same_checks(
    site: Path, tmp_path: Path, accel_home: Path, autocast_kept: None
) -> None:
    suite = install(site, "mut_fp16", "precision", {})
    suite.test_autocast_is_scoped_to_the_forward()
    suite.test_gradients_reach_every_parameter()
    suite.test_state_round_trips_through_checkpoints(tmp_path)


# ---- compilers: the counting-backend template -------------------------------------------------------------------

COMPILE_LINE = "        model.compile(backend=self.backend)\n"
COMPILED_COPY = """        pass

    @hookimpl(wrapper=True)
    def accel_prepare_training(self, models: list[Any]) -> Any:
        import copy

        import torch

        result = yield
        copies = [torch.compile(copy.deepcopy(model), backend=self.backend) for model in result[0]]
        return copies, result[1], result[2]
"""


@pytest.fixture
def fresh_dynamo() -> Any:
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiler_returning_a_copy_of_the_model_fails(site: Path, accel_home: Path, fresh_dynamo: None) -> None:
    suite = install(site, "mut_copy", "compiler", {"compiler.py": (COMPILE_LINE, COMPILED_COPY)})
    with pytest.raises(
        AssertionError, match=r"the user's module holds no gradient for .* \(a copy of the model\?\); compile in place"
    ):
        suite.test_compiled_model_computes_and_trains_like_the_eager_one()


def test_the_unchanged_compiler_template_passes_the_same_checks(
    site: Path, accel_home: Path, fresh_dynamo: None
) -> None:
    install(site, "mut_plain", "compiler", {}).test_compiled_model_computes_and_trains_like_the_eager_one()


# ---- plugins that are wired right and do nothing: the kit checks the effect --------------------------------------

BACKEND_RETURN = "        return graph.forward\n"
NO_GRAD_BACKEND = """        import torch

        def run(*args: Any) -> Any:
            with torch.no_grad():
                return graph.forward(*args)

        return run
"""
RETURNS_COMPILED = """        import torch

        return torch.compile(model, backend=self.backend)  # type: ignore[return-value]
"""
LAUNCHER = "launcher.py"
AUTOCAST_LINE = "        return functools.partial(torch.autocast, device, dtype=torch.float16)\n"
STATE_LINE = '        return {"mut_forget_scaler": self.scaler}\n'
FORGETFUL_STATE = """        scaler = self.scaler

        class Forgetful:
            def state_dict(self) -> Any:
                return scaler.state_dict()

            def load_state_dict(self, state: Any) -> None:
                pass  # restores nothing

        return {"mut_forget_scaler": Forgetful()}
"""

#: ``{plant: (template kind, changes, the kit test that must fail, what its message must say)}``: one plugin per
#: way of being wired right and doing nothing.
PLANTS: dict[str, tuple[str, dict[str, Edits], str, str]] = {
    "mut_uncompiled": (
        "compiler",
        {"compiler.py": (COMPILE_LINE, RETURNS_COMPILED)},
        "test_compiled_model_computes_and_trains_like_the_eager_one",
        r"plugin 'mut_uncompiled' compiled nothing: the prepared model's forward ran eagerly.*returning "
        r"torch.compile\(model\) compiles a model nobody calls",
    ),
    "mut_stale": (
        "compiler",
        {"compiler.py": (BACKEND_RETURN, "        return lambda *args: graph.forward(*example_inputs)\n")},
        "test_compiled_model_computes_and_trains_like_the_eager_one",
        r"returned the first batch's output for a second, different batch: its outputs do not follow its inputs",
    ),
    "mut_detached": (
        "compiler",
        {"compiler.py": (BACKEND_RETURN, NO_GRAD_BACKEND)},
        "test_compiled_model_computes_and_trains_like_the_eager_one",
        r"the output of the model plugin 'mut_detached' compiled does not require grad .* the compiled code cut the "
        r"autograd graph",
    ),
    "mut_cuda": (
        "precision",
        {PRECISION: (AUTOCAST_LINE, AUTOCAST_LINE.replace("device,", '"cuda",'))},
        "test_autocast_is_scoped_to_the_forward",
        r"mixed_precision='mut_cuda' did not change the compute dtype on the run's device \('cpu'\): the prepared "
        r"model's first linear layer computed in torch.float32.*a hard-coded 'cuda'.*torch warned, in the plugin's "
        r"autocast: 'CUDA is not available",
    ),
    "mut_forget": (
        "precision",
        {PRECISION: (STATE_LINE, FORGETFUL_STATE)},
        "test_state_round_trips_through_checkpoints",
        r"checkpoint item 'mut_forget_scaler' of plugin 'mut_forget' came back from load_state unlike it was saved "
        r"\(saved against loaded\): \['scale'\]: 32768.0 against 65536.0 \(loaded as a new Kernel starts it: "
        r"nothing was restored\)",
    ),
    "mut_count": (
        "launcher",
        {LAUNCHER: ('        n = settings["num_processes"]\n', "        n = 2\n")},
        "test_a_real_launch_carries_out_the_plan",
        r"plan \(num_processes\):\n- a real `accel launch -n 1` started 2 worker process\(es\), not 1.*\n.*a real `accel launch -n 3` started 2 "
        r"worker process\(es\), not 3 .*never a fixed count",
    ),
    "mut_env": (
        "launcher",
        {
            LAUNCHER: (
                '{**plan.env, "RANK"',
                '{**os.environ, **{k: plan.env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", '
                '"LOCAL_WORLD_SIZE")}, "RANK"',
            )
        },
        "test_a_real_launch_carries_out_the_plan",
        r"plan \(plan.env[^)]*\):\n(?:.*\n)*- a real `accel launch -n 3` started workers \(RANK 0, 1, 2\) without ACCEL_CONFIG: start each worker with "
        r"plan.env",
    ),
    "mut_port": (
        "launcher",
        {LAUNCHER: ('{**plan.env, "RANK"', '{**plan.env, "MASTER_PORT": "29400", "RANK"')},
        "test_a_real_launch_carries_out_the_plan",
        r"plan \(main_process_port\):\n- main_process_port was not carried out: `--main_process_port \d+` gave the "
        r"workers MASTER_PORT=29400, not \d+",
    ),
    "mut_restarts": (
        "launcher",
        {
            LAUNCHER: [
                ('    "max_restarts",\n', ""),
                (
                    "subprocesses{where}): {shlex",
                    "subprocesses{where}): --max_restarts={settings['max_restarts']} {shlex",
                ),
            ]
        },
        "test_a_real_launch_carries_out_the_plan",
        r"plan \(max_restarts\):\n- max_restarts was not carried out: a real `accel launch -n 1 --max_restarts 1` whose worker exited with 7 "
        r"once did not start it again and exited with 7",
    ),
}


@pytest.fixture
def effect_checks(tmp_path: Path, accel_home: Path, fresh_dynamo: None, autocast_kept: None) -> Path:
    """What the suites' own fixtures do (a private ACCEL_HOME, fresh dynamo caches, autocast restored)."""
    return tmp_path


def run_kit_test(suite: Any, test: str, tmp_path: Path) -> None:
    method = getattr(suite, test)
    method(tmp_path) if "tmp_path" in method.__code__.co_varnames else method()


@pytest.mark.multiprocess
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_plugin_that_does_nothing_fails_naming_the_problem(site: Path, effect_checks: Path, plant: str) -> None:
    kind, changes, test, message = PLANTS[plant]
    suite = install(site, plant, kind, changes)
    with pytest.raises(AssertionError) as failed:
        run_kit_test(suite, test, effect_checks)
    assert re.search(message, str(failed.value)), str(failed.value)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["compiler", "precision", "launcher"])
def test_the_unchanged_templates_pass_the_effect_checks(site: Path, effect_checks: Path, kind: str) -> None:
    suite = install(site, f"mut_same_{kind}", kind, {})
    for test in {test for plant_kind, _, test, _ in PLANTS.values() if plant_kind == kind}:
        (effect_checks / test).mkdir()
        run_kit_test(suite, test, effect_checks / test)


def test_a_state_difference_says_where_and_how_many() -> None:
    """Two long tensors that print alike (``tensor([0, 0, 0, ..., 0])``) are told apart by index and count."""
    import torch

    from accel.testing.model_check import state_difference

    saved = {"state": {"buffer": torch.zeros(1000, dtype=torch.uint8), "steps": 3}}
    loaded = {"state": {"buffer": torch.zeros(1000, dtype=torch.uint8), "steps": 3}}
    assert state_difference(saved, loaded) is None
    saved["state"]["buffer"][[500, 700]] = 9
    assert state_difference(saved, loaded) == (
        "['state']['buffer']: 2 of 1000 elements differ, the first at index 500: 9 against 0"
    )
    loaded["state"]["buffer"] = torch.zeros(10, dtype=torch.uint8)
    assert "torch.uint8 of shape (1000,) against torch.uint8 of shape (10,)" in str(state_difference(saved, loaded))


def test_a_check_gained_since_a_plugins_release_warns_with_every_problem_on_the_first_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pytest's warnings summary shows a warning's first line only: every ignored setting is named there."""
    from accel.testing import conformance

    monkeypatch.setattr(conformance, "written_for", lambda plugin: (0, 1, 0))

    def check() -> None:
        raise AssertionError("launch settings the launcher ignores: tee, log_dir\n- tee was ...\n- log_dir was ...")

    with pytest.warns(FutureWarning) as caught:
        conformance.added_check("old", "0.1.1", "0.2.0", check)
    first = str(caught[0].message).splitlines()[0]
    assert "ignores: tee, log_dir - tee was ... - log_dir was ..." in first, first
