"""Plugin discovery and control, with real distributions installed by pip (tests/plugin_pkgs): `accel plugins`,
--plugin, -p no:, ACCEL_DISABLE_PLUGINS, ACCEL_PLUGINS, broken plugins isolated, duplicate names refused."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from clitools import GOOD_AND_BROKEN, TESTS, clean_env, install, pythonpath, run

from accel import Component, Options, PluginError, Settings, hookimpl
from accel.builtin import BUILTIN_PLUGINS
from accel.options import resolve
from accel.plugins import Plugins

PROBE = str(TESTS / "scripts" / "cli_probe.py")


@pytest.fixture(scope="module")
def site() -> Path:
    return install(*GOOD_AND_BROKEN)


@pytest.fixture(scope="module")
def fork_site() -> Path:
    return install("hello_fork")


@pytest.fixture
def env(tmp_path: Path, site: Path) -> dict[str, str]:
    return clean_env(tmp_path, PYTHONPATH=pythonpath(site), COLUMNS="250")


def rows(result) -> dict[str, dict]:
    assert result.returncode == 0, result
    return {row["name"]: row for row in json.loads(result.stdout)}


def one_error(result, *needles: str) -> str:
    """The run failed as bad input: exit 2, exactly one non-empty stderr line, no traceback; return that line."""
    assert result.returncode == 2, result
    assert len(result.err_lines) == 1, result
    assert "Traceback" not in result.stderr + result.stdout, result
    line = result.err_lines[0]
    assert line.startswith("accel: error: "), result
    for needle in needles:
        assert needle in line, (needle, line)
    return line


# ---- discovery and `accel plugins` -------------------------------------------------------------------------------


def test_plugins_json_reports_every_installed_plugin(env):
    found = rows(run(["plugins", "--json"], env))
    hello = found["hello"]
    assert hello["distribution"] == "accel-plugin-hello"
    assert hello["version"] == "0.3.1"
    assert hello["status"] == "active" and hello["reason"] == ""
    assert hello["entry_point"] == "accel_hello"
    # discovery hooks of the module and runtime hooks of its component (from `accel_components`)
    assert {"accel_add_options", "accel_activate", "accel_transform_model", "accel_teardown"} <= set(hello["hooks"])
    assert found["ddp"]["status"] == "active"
    assert set(hello) >= {"name", "distribution", "version", "hooks", "status"}


def test_broken_plugins_are_reported_and_isolated(env):
    found = rows(run(["plugins", "--json"], env))
    broken, misspelt, leaky = found["broken"], found["misspelt"], found["leaky"]
    assert broken["distribution"] == "accel-plugin-broken"
    assert broken["status"] == "failed"
    assert "import failed: RuntimeError: accel_broken cannot be imported" in broken["reason"]
    # check_pending: a misspelt hook is an error naming the plugin and the hook, with a suggestion
    assert misspelt["status"] == "failed"
    assert "unknown hook 'accel_add_option'" in misspelt["reason"] and "accel_add_options" in misspelt["reason"]
    assert leaky["status"] == "failed"
    assert "accel_prepare_dataloader at module level" in leaky["reason"]
    assert all(found[n]["hooks"] == [] for n in ("broken", "misspelt", "leaky"))
    # the others keep working
    assert found["hello"]["status"] == "active" and found["ddp"]["status"] == "active"


def test_plugins_table(env):
    result = run(["plugins"], env)
    assert result.returncode == 0, result
    out = result.stdout
    for column in ("name", "distribution", "version", "hooks", "status"):
        assert re.search(rf"\b{column}\b", out.splitlines()[2] + out.splitlines()[1]), out
    hello = next(line for line in out.splitlines() if "accel-plugin-hello" in line)
    assert "hello" in hello and "0.3.1" in hello and "active" in hello and "accel_activate" in hello
    broken = next(line for line in out.splitlines() if "accel-plugin-broken" in line)
    assert "failed: import failed: RuntimeError" in broken


def test_disable_with_p_no_and_environment(env):
    found = rows(run(["plugins", "--json", "-p", "no:hello"], env))
    assert found["hello"]["status"] == "disabled" and found["hello"]["reason"] == "disabled by -p no:hello"
    assert found["hello"]["hooks"] == []  # never imported
    found = rows(run(["plugins", "--json"], {**env, "ACCEL_DISABLE_PLUGINS": "hello,broken"}))
    assert found["hello"]["status"] == "disabled" and "ACCEL_DISABLE_PLUGINS" in found["hello"]["reason"]
    assert found["broken"]["status"] == "disabled"  # disabled before import: no failure to report
    assert found["ddp"]["status"] == "active"


def test_allow_list(env):
    found = rows(run(["plugins", "--json"], {**env, "ACCEL_PLUGINS": "hello"}))
    assert found["hello"]["status"] == "active"
    for name in ("ddp", "broken", "misspelt", "leaky"):
        assert found[name]["status"] == "disabled" and found[name]["reason"] == "not in ACCEL_PLUGINS", found[name]
    found = rows(run(["plugins", "--json"], {**env, "ACCEL_PLUGINS": ""}))
    # an empty allow-list leaves every installed plugin out; the built-in ones are always there
    assert {row["status"] for row in found.values() if row["status"] != "built-in"} == {"disabled"}
    assert [n for n, row in found.items() if row["status"] == "built-in"] == [n for n, _ in BUILTIN_PLUGINS]


def test_duplicate_names_refuse_both_naming_both(env, fork_site, site):
    env = {**env, "PYTHONPATH": pythonpath(Path(env["PYTHONPATH"]), fork_site)}
    result = run(["plugins", "--json"], env)
    assert result.returncode == 0, result
    hellos = [row for row in json.loads(result.stdout) if row["name"] == "hello"]
    assert sorted(r["distribution"] for r in hellos) == ["accel-plugin-hello", "accel-plugin-hello-fork"]
    for row in hellos:
        assert row["status"] == "failed"
        assert "accel-plugin-hello 0.3.1" in row["reason"] and "accel-plugin-hello-fork 0.2.0" in row["reason"]
    one_error(
        run(["launch", "--plugin", "hello", PROBE], env),
        "plugin 'hello'",
        "accel-plugin-hello 0.3.1",
        "accel-plugin-hello-fork 0.2.0",
    )
    # the rest keeps working
    ok = run(["launch", "--dry-run", PROBE], env)
    assert ok.returncode == 0, ok


# ---- launching with plugins ----------------------------------------------------------------------------------------


def test_launch_selects_hello_and_its_flag(env):
    result = run(["launch", "--plugin", "hello", "--hello_greeting", "bonjour", PROBE, "a", "b"], env)
    assert result.returncode == 0, result
    assert "[hello] bonjour from process 0/1: Linear with 8 parameters" in result.stdout
    assert "[hello] goodbye from process 0" in result.stdout
    assert "components=['hello'] args=['a', 'b']" in result.stdout
    # the broken plugins are reported once each, the run goes on
    for name in ("broken", "misspelt", "leaky"):
        assert any(f"plugin '{name}'" in line and "is skipped" in line for line in result.err_lines), result


def test_installed_but_not_selected_changes_nothing(env):
    result = run(["launch", "-q", PROBE], env)
    assert result.returncode == 0, result
    assert "[hello]" not in result.stdout
    assert "hello_imported=True components=[]" in result.stdout


@pytest.mark.slow
def test_p_no_reaches_the_workers(env):
    result = run(["launch", "-q", "-p", "no:hello", PROBE], env)
    assert result.returncode == 0, result
    assert "hello_imported=False components=[]" in result.stdout  # the worker did not even import it


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hello_in_every_process(env):
    result = run(["launch", "-q", "-n", "2", "--plugin", "hello", PROBE], env)
    assert result.returncode == 0, result
    for rank in (0, 1):
        assert f"[hello] hello from process {rank}/2" in result.stdout, result
        assert f"PROBE rank={rank} world=2 hello_imported=True components=['ddp', 'hello']" in result.stdout


@pytest.mark.parametrize(
    "extra, args, needles",
    [
        ({}, ["-p", "no:hello"], ["plugin 'hello'", "disabled by -p no:hello"]),
        ({"ACCEL_DISABLE_PLUGINS": "hello"}, [], ["plugin 'hello'", "disabled by ACCEL_DISABLE_PLUGINS"]),
        ({"ACCEL_PLUGINS": "ddp"}, [], ["plugin 'hello'", "not in ACCEL_PLUGINS"]),
        ({}, [], None),
    ],
    ids=["p-no", "deny-env", "allow-env", "enabled"],
)
def test_selecting_a_disabled_plugin_is_an_error(env, extra, args, needles):
    result = run(["launch", "--dry-run", *args, "--plugin", "hello", PROBE], {**env, **extra})
    if needles is None:
        assert result.returncode == 0, result
        assert "active plugins: hello (observer)" in result.stdout
    else:
        one_error(result, *needles)


@pytest.mark.parametrize(
    "name, needles",
    [
        ("broken", ["plugin 'broken'", "accel-plugin-broken 0.1.0", "RuntimeError: accel_broken cannot be imported"]),
        ("misspelt", ["plugin 'misspelt'", "unknown hook 'accel_add_option'"]),
        ("leaky", ["plugin 'leaky'", "accel_prepare_dataloader at module level"]),
    ],
)
def test_requesting_a_failed_plugin_is_one_line(env, name, needles):
    one_error(run(["launch", "--plugin", name, PROBE], env), *needles)


# ---- the same rules in process (no subprocess): components and options -------------------------------------------


def module(name: str, **attrs: object) -> types.ModuleType:
    mod = types.ModuleType(f"accel_{name}")
    mod.__dict__.update(attrs)
    return mod


def _settings(plugins: Plugins, **values) -> Settings:
    resolved, sources = resolve(plugins.options(), kwargs=values, env={})
    return Settings(resolved, sources, world_size=1, phase="run", env={})


def test_component_with_misspelt_hook_is_an_error_naming_the_plugin():
    class Typo(Component):
        role = "observer"

        @hookimpl
        def accel_prepare_trainin(self, kernel, models):
            return None

    plugin = module("typo", accel_activate=hookimpl(lambda settings: Typo()))
    plugins = Plugins.load(env={"ACCEL_PLUGINS": ""}, extra=[("typo", plugin)])
    with pytest.raises(
        PluginError, match=r"plugin 'typo'.*'accel_prepare_trainin'.*did you mean `accel_prepare_training`"
    ):
        plugins.activate(_settings(plugins))


@pytest.fixture(scope="module")
def badcomponent_site() -> Path:
    return install("badcomponent")


def test_component_class_with_misspelt_hook_is_failed_at_discovery(tmp_path, badcomponent_site):
    env = clean_env(tmp_path, PYTHONPATH=pythonpath(badcomponent_site), COLUMNS="250")
    row = rows(run(["plugins", "--json"], env))["badcomponent"]
    assert row["status"] == "failed", row
    assert "Typo implements unknown hook 'accel_prepare_trainin'" in row["reason"], row
    assert "did you mean `accel_prepare_training`" in row["reason"], row
    one_error(run(["launch", "--plugin", "badcomponent", PROBE], env), "plugin 'badcomponent'", "accel_prepare_trainin")


class Defaults(Component):
    @hookimpl
    def accel_log(self, kernel, values, step=None):
        return None


def test_implementation_argument_with_a_default_is_refused_naming_plugin_hook_and_argument(monkeypatch):
    holder = module("defaults_components", Defaults=Defaults)
    monkeypatch.setitem(__import__("sys").modules, "accel_defaults_components", holder)
    listed = module(
        "listed",
        accel_components=["accel_defaults_components:Defaults"],
        accel_activate=hookimpl(lambda settings: None),
    )
    at_module = module("atmodule", accel_add_options=hookimpl(lambda options=None: None))
    plugins = Plugins.load(env={"ACCEL_PLUGINS": ""}, extra=[("listed", listed), ("atmodule", at_module)])
    for name, hook, arg in (("listed", "accel_log", "step"), ("atmodule", "accel_add_options", "options")):
        rec = plugins.records[name]
        assert rec.status == "failed", rec
        assert f"{hook} gives argument {arg!r} a default value" in rec.reason and "remove the default" in rec.reason
    # a component that is not listed in accel_components is checked when Kernel() registers it
    plugin = module("unlisted", accel_activate=hookimpl(lambda settings: Defaults()))
    plugins = Plugins.load(env={"ACCEL_PLUGINS": ""}, extra=[("unlisted", plugin)])
    with pytest.raises(PluginError, match=r"plugin 'unlisted': Defaults.accel_log gives argument 'step' a default"):
        plugins.activate(_settings(plugins))


@pytest.mark.parametrize(
    "name, extra, cause",
    [
        ("broken", {}, "plugin 'broken' is installed but failed: import failed: RuntimeError"),
        (
            "hello",
            {"ACCEL_DISABLE_PLUGINS": "hello"},
            "plugin 'hello' is installed but disabled: disabled by ACCEL_DISABLE_PLUGINS",
        ),
    ],
)
def test_log_with_a_tracker_that_cannot_be_used_names_the_real_cause(env, name, extra, cause):
    script = f"from accel import Kernel, UsageError\ntry:\n    Kernel(log_with={name!r})\nexcept UsageError as e:\n    print(e)"
    proc = subprocess.run(
        [sys.executable, "-c", script], env={**env, **extra}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and cause in proc.stdout, proc
    assert "did you mean" not in proc.stdout and "no published plugin" not in proc.stdout, proc


def test_option_declared_twice_names_both_plugins():
    def declare(options: Options) -> None:
        options.add("shared_flag", type="bool", default=False)

    one = module("one", accel_add_options=hookimpl(declare))
    two = module("two", accel_add_options=hookimpl(declare))
    plugins = Plugins.load(env={"ACCEL_PLUGINS": ""}, extra=[("one", one), ("two", two)])
    with pytest.raises(PluginError, match=r"`shared_flag` is declared by both '(one|two)' and '(one|two)'"):
        plugins.options()


def test_same_module_under_two_names_leaves_the_first_working():
    mod = module("twice", accel_add_options=hookimpl(lambda options: None))
    plugins = Plugins.load(env={"ACCEL_PLUGINS": ""}, extra=[("first", mod), ("second", mod)])
    assert plugins.records["first"].status == "loaded"
    assert plugins.records["second"].status == "failed"
    assert plugins.pm.get_plugin("first") is mod
