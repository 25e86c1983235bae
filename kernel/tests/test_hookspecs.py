"""accel.hookspecs, the hook contract as code: every hook says when it is called and who answers (its docstring),
what it returns (its annotation; ``-> None`` hooks say they return nothing), and its calling rule matches the words
(``firstresult`` exactly where the docstring says "first answer wins", and then ``None`` means no answer); the
discovery hooks are the ones without a kernel, the runtime hooks take the kernel first (``accel_launch``: the launch
plan, as there is no Kernel in ``accel launch``); no argument has a default (pluggy would never pass it).
docs/hooks.md, generated from these docstrings, is checked in test_hooks_doc.py."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pluggy
import pytest

from accel import hookspecs, spi

SPECS: dict[str, Callable[..., Any]] = {
    name: fn
    for name, fn in vars(hookspecs).items()
    if name.startswith("accel_") and callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")
}


def spec_options(name: str) -> dict[str, Any]:
    return getattr(SPECS[name], f"{hookspecs.PROJECT}_spec")


def who(name: str) -> str:
    """The docstring's "Who:" sentence."""
    doc = inspect.getdoc(SPECS[name]) or ""
    return " ".join(doc.split("Who:", 1)[1].split(".", 1)[0].split())


def test_every_hook_function_is_a_spec() -> None:
    """A function named accel_* in the module without the spec mark would be a hook nobody can implement."""
    functions = [n for n, f in vars(hookspecs).items() if n.startswith("accel_") and inspect.isfunction(f)]
    assert functions == list(SPECS) and len(SPECS) >= 30


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_docstring_says_when_and_who(name: str) -> None:
    doc = inspect.getdoc(SPECS[name]) or ""
    summary, _, rest = doc.partition("\n\n")
    assert summary.strip() and "When:" in rest and "Who:" in rest, f"{name}: a summary, then When: and Who:"
    assert rest.index("When:") < rest.index("Who:"), name
    assert who(name), name


@pytest.mark.parametrize("name", sorted(SPECS))
def test_first_answer_wins_exactly_for_firstresult_hooks(name: str) -> None:
    firstresult = spec_options(name)["firstresult"]
    assert who(name).startswith("first answer wins") == firstresult, (name, who(name))
    assert ("first answer wins" in who(name)) == firstresult, (name, who(name))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_return_is_annotated_and_a_firstresult_hook_may_pass(name: str) -> None:
    """The annotation says what an answer is; a first-answer hook's ``None`` passes to the next implementation (or
    the kernel's default), and a hook annotated ``-> None`` says it returns nothing."""
    returned = inspect.signature(SPECS[name]).return_annotation
    assert returned is not inspect.Signature.empty, f"{name} has no return annotation"
    if spec_options(name)["firstresult"]:
        assert "None" in str(returned).split("|")[-1], (name, returned)
    if returned == "None":
        assert "Returns nothing" in " ".join((inspect.getdoc(SPECS[name]) or "").split()), name


#: Runtime hooks asked in ``accel launch``, where there is no Kernel: the launch plan comes first instead.
LAUNCH_HOOKS = {"accel_launch": "plan"}


def test_discovery_hooks_take_no_kernel_and_runtime_hooks_take_it_first() -> None:
    assert set(hookspecs.DISCOVERY_HOOKS) <= set(SPECS) and set(LAUNCH_HOOKS) <= set(SPECS)
    for name, fn in SPECS.items():
        params = list(inspect.signature(fn).parameters)
        if name in hookspecs.DISCOVERY_HOOKS:
            assert "kernel" not in params, name
        else:
            assert params[:1] == [LAUNCH_HOOKS.get(name, "kernel")], (name, params)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_no_argument_has_a_default(name: str) -> None:
    """pluggy passes only arguments without defaults: one with a default would always get its default."""
    defaults = [p.name for p in inspect.signature(SPECS[name]).parameters.values() if p.default is not p.empty]
    assert defaults == [], (name, defaults)


def test_the_markers_are_the_projects_and_the_plugin_api_exports_them() -> None:
    assert hookspecs.PROJECT == "accel"
    assert isinstance(hookspecs.hookspec, pluggy.HookspecMarker) and hookspecs.hookspec.project_name == "accel"
    assert isinstance(hookspecs.hookimpl, pluggy.HookimplMarker) and hookspecs.hookimpl.project_name == "accel"
    assert spi.hookimpl is hookspecs.hookimpl and spi.hookspec is hookspecs.hookspec


def test_a_plugin_manager_takes_the_specs_as_the_kernel_declares_them() -> None:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    assert {name for name in dir(pm.hook) if name.startswith("accel_")} >= set(SPECS)
    for name in SPECS:
        caller = getattr(pm.hook, name)
        assert caller.spec is not None and caller.spec.opts["firstresult"] == spec_options(name)["firstresult"]


def test_the_contracts_list_of_discovery_hooks_is_the_codes() -> None:
    """The module docstring (the contract's text, docs/hooks.md's head) names exactly the hooks of DISCOVERY_HOOKS
    in its list of discovery hooks, so adding one to the code without the text (or the reverse) fails here."""
    import re

    text = hookspecs.__doc__ or ""
    listed = text.split("1. **Discovery hooks** (", 1)[1].split(")", 1)[0]
    assert set(re.findall(r"``(accel_\w+)``", listed)) == set(hookspecs.DISCOVERY_HOOKS)
