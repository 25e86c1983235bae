"""``accel_unavailable_reason``: a plugin that is installed but cannot be used here (backend missing or built for
another torch) is listed as unavailable with its reason, keeps its options, is asked only ``accel_activate`` (where
it may still take part, e.g. a TPU pod launch), and asking for it while it stays out is one UsageError with the
reason. In process, with plugin modules registered directly (no packages)."""

from __future__ import annotations

import types

import pytest

from accel import Component, HardwareInfo, Options, Settings, UsageError, hookimpl
from accel.options import resolve
from accel.plugins import Plugins

REASON = "fakebackend 1.0 needs torch 1.0.*, found 2.13.0: install torch==1.0.*"


class Active(Component):
    role = "observer"


def fake_plugin(reason: str | None, calls: list[str], works_without_backend: bool = False) -> types.ModuleType:
    mod = types.ModuleType("accel_fake")

    def add_options(options: Options) -> None:
        options.add("use_fake", type="bool", default=False, config_key="fake_config.enabled", env=("ACCEL_USE_FAKE",))
        options.add("fake_level", default="O1", choices=("O0", "O1"))

    def activate(settings: Settings) -> Component | None:
        calls.append("activate")
        if reason and not works_without_backend:
            return None  # the contract: an unavailable plugin stays out unless it can do without its backend
        return Active() if settings.is_selected("fake") or settings["use_fake"] else None

    def detect(env) -> HardwareInfo:
        calls.append("detect")
        return HardwareInfo(name="fakedevice", device_count=4, priority=50)

    mod.accel_add_options = hookimpl(add_options)
    mod.accel_activate = hookimpl(activate)
    mod.accel_detect_hardware = hookimpl(detect)
    mod.accel_unavailable_reason = hookimpl(lambda: reason)
    return mod


def load(reason: str | None, works_without_backend: bool = False) -> tuple[Plugins, list[str]]:
    calls: list[str] = []
    module = fake_plugin(reason, calls, works_without_backend)
    return Plugins.load(env={"ACCEL_PLUGINS": ""}, extra=[("fake", module)]), calls


def settings(registry: Plugins, env: dict[str, str] | None = None, **values) -> Settings:
    resolved, sources = resolve(registry.options(), kwargs=values, env=env or {})
    return Settings(resolved, sources, world_size=1, phase="run", env=env or {})


def test_a_usable_plugin_is_loaded_and_activates():
    plugins, calls = load(None)
    assert plugins.records["fake"].status == "loaded"
    assert plugins.detect_hardware({}).name == "fakedevice"
    assert [c.name for c in plugins.activate(settings(plugins, plugins=["fake"]))] == ["fake"]


def test_unavailable_plugin_is_listed_with_its_reason_and_keeps_its_options():
    plugins, calls = load(REASON)
    rec = plugins.records["fake"]
    assert (rec.status, rec.reason) == ("unavailable", REASON)
    assert "fake" not in plugins.loaded
    assert plugins.unavailable()["fake"] == f"unavailable: {REASON}"
    assert "fake (unavailable)" in plugins.describe_installed()
    assert {"use_fake", "fake_level"} <= {o.name for o in plugins.options()}  # its flags and keys still parse
    assert plugins.detect_hardware({}).name == "cpu" and calls == []  # its other discovery hooks are not asked ...
    assert plugins.activate(settings(plugins)) == [] and calls == ["activate"]  # ... but accel_activate is
    assert plugins.require("fake") is rec  # selecting it is left to its accel_activate and the check after it


@pytest.mark.parametrize(
    "values, env, where",
    [
        ({"plugins": ["fake"]}, {}, "plugin 'fake' ((registered directly) ) cannot be used here: "),
        ({"use_fake": True}, {}, "Kernel(use_fake=...) needs plugin 'fake'"),
        ({"fake_level": "O0"}, {}, "Kernel(fake_level=...) needs plugin 'fake'"),
        ({}, {"ACCEL_USE_FAKE": "1"}, "environment variable ACCEL_USE_FAKE needs plugin 'fake'"),
    ],
    ids=["selected", "option", "other-option", "env"],
)
def test_asking_for_an_unavailable_plugin_is_a_usage_error_with_the_reason(values, env, where):
    plugins, calls = load(REASON)
    with pytest.raises(UsageError) as info:
        plugins.activate(settings(plugins, env=env, **values))
    message = str(info.value)
    assert where in message and message.endswith(REASON) and "\n" not in message
    assert calls == ["activate"]


def test_options_left_at_their_defaults_do_not_ask_for_it():
    plugins, calls = load(REASON)
    assert plugins.activate(settings(plugins, use_fake=False, fake_level="O1")) == []


def test_a_reason_hook_that_raises_marks_the_plugin_failed():
    mod = types.ModuleType("accel_raises")

    def boom() -> str:
        raise RuntimeError("cannot read metadata")

    mod.accel_unavailable_reason = hookimpl(boom)
    plugins = Plugins.load(env={"ACCEL_PLUGINS": ""}, extra=[("raises", mod)])
    rec = plugins.records["raises"]
    assert rec.status == "failed"
    assert rec.reason == "accel_unavailable_reason failed: RuntimeError: cannot read metadata"


@pytest.mark.parametrize("values", [{"plugins": ["fake"]}, {"use_fake": True}], ids=["selected", "option"])
def test_an_unavailable_plugin_that_takes_part_anyway_is_not_refused(values):
    """A plugin may do without its backend here (a TPU pod launch only runs gcloud on this machine)."""
    plugins, calls = load(REASON, works_without_backend=True)
    assert [c.name for c in plugins.activate(settings(plugins, **values))] == ["fake"]


def test_the_reason_is_one_line() -> None:
    plugins, _ = load("libthing is not installed\n  (pip install thing)")
    assert plugins.records["fake"].reason == "libthing is not installed (pip install thing)"
