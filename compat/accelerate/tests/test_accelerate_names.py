"""Every ``Accelerator`` argument and public member of Accelerate, and every public name of ``accelerate``,
``accelerate.utils``, ``accelerate.data_loader`` and ``accelerate.state`` (the checked-in list
tests/data/accelerate_names.json, written by tests/data/list_accelerate_names.py under Accelerate itself) either
works on ``Kernel`` under its own name, has an accel name, or is refused with one line saying what to use instead;
the guide's table is the mapping's (compat/accelerate/src/accel_accelerate/accelerate_names.json)."""

from __future__ import annotations

import fnmatch
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import operator
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from accel.errors import UsageError
from accel.kernel import Kernel
from accel.testing import make_kernel
from accel_accelerate.names import (
    accelerate_modules,
    accelerate_names,
    markdown_table,
    module_name_entry,
    modules_table,
)

ROOT = Path(__file__).resolve().parents[3]
LISTED = json.loads((ROOT / "tests" / "data" / "accelerate_names.json").read_text())
MAPPING = accelerate_names()
GUIDE = ROOT / "docs" / "migrating-from-accelerate.md"
#: the plugin that gives the kernel the lines of these tables (accel_explain_name)
NAMES = ["accelerate-names"]
BEGIN, END = "<!-- accelerate-names: begin -->", "<!-- accelerate-names: end -->"


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    k = make_kernel(NAMES)
    yield k
    k.end_training()


def test_the_list_is_accelerate_1_15s_and_every_name_is_mapped() -> None:
    assert LISTED["accelerate"] == MAPPING["accelerate"] == "1.15.0"
    assert len(LISTED["arguments"]) == 21 and len(LISTED["members"]) > 100
    for part in ("arguments", "members"):
        unmapped = sorted(set(LISTED[part]) - set(MAPPING[part]))
        stale = sorted(set(MAPPING[part]) - set(LISTED[part]))
        assert not unmapped, f"{part} of Accelerate with no entry in accelerate_names.json: {unmapped}"
        assert not stale, f"entries for {part} Accelerate does not have: {stale}"


@pytest.mark.parametrize("part", ["arguments", "members"])
def test_every_entry_is_same_renamed_or_refused_with_one_line(part: str) -> None:
    for name, entry in MAPPING[part].items():
        assert entry["status"] in ("same", "renamed", "refused"), name
        if entry["status"] == "renamed":
            assert entry["accel"], name
        if entry["status"] == "refused":
            message = entry["message"]
            assert message and "\n" not in message and len(message) < 300, name
            assert ":" in message, f"{name}: the message must say what to use instead"


@pytest.mark.parametrize("name", LISTED["arguments"])
def test_each_accelerate_argument_works_or_is_refused_with_its_message(name: str) -> None:
    entry = MAPPING["arguments"][name]
    params = set(inspect.signature(Kernel.__init__).parameters)
    if entry["status"] == "refused":
        assert name not in params
        with pytest.raises(UsageError) as info:
            make_kernel(NAMES, **{name: object()})
        assert str(info.value) == entry["message"]
    else:
        assert entry["status"] == "same" and name in params, name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"deepspeed_plugin": object()},
            r"^Kernel\(deepspeed_plugin=...\) is not supported: .*plugins=\['deepspeed'\]",
        ),
        ({"fsdp_plugin": object()}, r"plugins=\['fsdp'\]"),
        ({"megatron_lm_plugin": object()}, r"no Megatron-LM plugin"),
        ({"dynamo_plugin": object()}, r"dynamo_backend="),
        ({"parallelism_config": object()}, r"needs accel-plugin-parallel"),
        ({"torch_tp_plugin": object()}, r"parallelism_config=ParallelismConfig\(tp_size=N\)"),
    ],
)
def test_accelerate_plugin_arguments_say_what_to_use_in_one_line(kwargs: dict[str, Any], message: str) -> None:
    """The plugin objects Accelerate takes as arguments: one line naming accel's plugin or option instead."""
    with pytest.raises(UsageError, match=message) as info:
        make_kernel(NAMES, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", LISTED["members"])
def test_each_accelerate_member_works_or_says_what_to_use(kernel: Kernel, name: str) -> None:
    entry = MAPPING["members"][name]
    if entry["status"] == "same":
        assert hasattr(kernel, name), f"the table says Kernel has {name!r}"
        return
    with pytest.raises(AttributeError) as info:
        getattr(kernel, name)
    if entry["status"] == "renamed":
        operator.attrgetter(entry["accel"])(kernel)  # the accel name exists
        assert f"use kernel.{entry['accel']}" in str(info.value)
    else:
        assert str(info.value) == entry["message"]


def test_an_unknown_attribute_is_still_a_plain_attribute_error(kernel: Kernel) -> None:
    with pytest.raises(AttributeError, match="'Kernel' object has no attribute 'no_such_member'"):
        _ = kernel.no_such_member  # type: ignore[attr-defined]


def test_the_guides_table_is_the_mappings() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"{GUIDE.name} must hold the table between {BEGIN} and {END}"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert shown == markdown_table(), (
        "the name table in docs/migrating-from-accelerate.md is out of date: replace it with the output of "
        "`python -m accel_accelerate.names`"
    )


# ---- the public names of accelerate, accelerate.utils, accelerate.data_loader and accelerate.state -------------

MODULES = accelerate_modules()
MODULE_BEGIN, MODULE_END = "<!-- accelerate-modules: begin -->", "<!-- accelerate-modules: end -->"


def test_every_public_name_of_the_four_modules_has_an_entry() -> None:
    listed = LISTED["modules"]
    assert set(listed) == {"accelerate", "accelerate.utils", "accelerate.data_loader", "accelerate.state"}
    assert len(listed["accelerate.utils"]) > 200 and "gather" in listed["accelerate.utils"]
    missing = sorted(
        f"{module}.{name}" for module, names in listed.items() for name in names if module_name_entry(name) is None
    )
    assert not missing, f"public names of Accelerate with no entry in accelerate_modules.json: {missing}"
    every = {name for names in listed.values() for name in names}
    stale = sorted(set(MODULES["names"]) - every)
    assert not stale, f"entries for names Accelerate's modules do not have: {stale}"
    for pattern in MODULES["patterns"]:
        assert any(fnmatch.fnmatchcase(name, pattern) for name in every), f"pattern {pattern!r} matches nothing"


def test_a_name_without_an_entry_is_found() -> None:
    assert module_name_entry("gather") == ("gather", MODULES["names"]["gather"])
    assert module_name_entry("is_wandb_available") == ("is_*_available", MODULES["patterns"]["is_*_available"])
    assert module_name_entry("no_such_accelerate_name") is None


def test_every_module_entry_is_an_accel_name_or_a_one_line_refusal() -> None:
    for key, entry in [*MODULES["names"].items(), *MODULES["patterns"].items()]:
        assert ("accel" in entry) != ("refused" in entry), key
        text = entry.get("refused") or entry.get("note", "")
        assert "\n" not in text and len(text) < 300, key
        if "refused" in entry:
            assert entry["refused"], key
        else:
            assert entry["accel"].startswith(("accel.", "accel_", "kernel.")), key


@pytest.mark.parametrize("key", sorted(k for k, e in MODULES["names"].items() if "accel" in e))
def test_each_mapped_module_name_exists_in_accel(kernel: Kernel, key: str) -> None:
    accel = MODULES["names"][key]["accel"]
    if accel.startswith("kernel."):
        operator.attrgetter(accel.removeprefix("kernel."))(kernel)
        return
    module, _, attr = accel.rpartition(".")
    if module.startswith("accel_") and importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"{module} is a plugin this venv does not have")
    try:
        value = getattr(importlib.import_module(module), attr)
    except AttributeError as error:  # a name a plugin brings (accel.utils re-exports it) where that plugin is absent
        distribution = str(error).rpartition("pip install ")[2]
        if "comes with plugin" not in str(error) or not distribution.startswith("accel-plugin-"):
            raise
        with pytest.raises(importlib.metadata.PackageNotFoundError):  # absent indeed: the message says what to install
            importlib.metadata.distribution(distribution)
        return
    assert value is not None


def test_the_guides_module_table_is_the_mappings() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    assert MODULE_BEGIN in text and MODULE_END in text
    shown = text.split(MODULE_BEGIN, 1)[1].split(MODULE_END, 1)[0].strip("\n") + "\n"
    assert shown == modules_table(), (
        "the module table in docs/migrating-from-accelerate.md is out of date: replace it with the second table "
        "`python -m accel_accelerate.names` prints"
    )


def test_python_m_accel_accelerate_names_prints_both_tables() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "accel_accelerate.names"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out == markdown_table() + "\n" + modules_table()
