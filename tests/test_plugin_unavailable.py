"""The kernel's `accel_unavailable_reason` hook: an installed plugin whose backend cannot run here is listed as
unavailable with its reason, stays registered (its options are accepted, its accel_activate decides), and a broken
check is reported instead of breaking discovery. The real case (torch-xla next to the wrong torch) is in
tests/test_xla_plugin.py."""

from __future__ import annotations

import types

import pytest

from accel import Settings, UsageError, hookimpl
from accel.options import resolve
from accel.plugins import Plugins


def plugin(reason: object) -> types.SimpleNamespace:
    @hookimpl
    def accel_add_options(options):
        options.add("needs_lib_path", help="where libthing lives")

    @hookimpl
    def accel_unavailable_reason():
        if isinstance(reason, Exception):
            raise reason
        return reason

    @hookimpl
    def accel_activate(settings):
        return None

    return types.SimpleNamespace(accel_add_options=accel_add_options, accel_unavailable_reason=accel_unavailable_reason,
                                 accel_activate=accel_activate)


def load(reason: object) -> Plugins:
    return Plugins.load(env={"ACCEL_PLUGINS": ""}, extra=[("needslib", plugin(reason))])


def test_a_reason_marks_the_plugin_unavailable_but_keeps_it_registered() -> None:
    plugins = load("libthing is not installed\n  (pip install thing)")
    rec = plugins.records["needslib"]
    assert (rec.status, rec.reason) == ("unavailable", "libthing is not installed (pip install thing)")
    assert "accel_unavailable_reason" in rec.hooks
    assert "needslib" not in plugins.loaded and rec not in plugins.failed
    assert plugins.unavailable()["needslib"] == "unavailable: libthing is not installed (pip install thing)"
    assert "needslib (unavailable)" in plugins.describe_installed()
    assert "needs_lib_path" in plugins.options()  # its options still parse (a config file naming them still loads)
    assert plugins.require("needslib") is rec  # selecting it is left to its accel_activate, which may refuse ...
    values, sources = resolve(plugins.options(), kwargs={"plugins": ["needslib"]}, env={})
    with pytest.raises(UsageError, match=r"^plugin 'needslib' \(\(registered directly\) \) cannot be used here: "
                                         r"libthing is not installed \(pip install thing\)$"):
        plugins.activate(Settings(values, sources, env={}))  # ... and if it just stays out, the kernel says why


def test_no_reason_keeps_it_loaded() -> None:
    plugins = load(None)
    assert plugins.records["needslib"].status == "loaded" and "needslib" in plugins.loaded


def test_a_failing_check_is_the_reason() -> None:
    rec = load(RuntimeError("boom")).records["needslib"]
    assert (rec.status, rec.reason) == ("unavailable", "accel_unavailable_reason failed: RuntimeError: boom")
