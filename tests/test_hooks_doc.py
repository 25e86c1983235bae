"""docs/hooks.md documents every hook of accel/hookspecs.py with its current arguments, and for each hook says how
DDP answers it today and how FSDP, DeepSpeed, XLA, a precision plugin, a dynamo plugin and trackers will."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from accel import hookspecs

DOC = Path(__file__).resolve().parents[1] / "docs" / "hooks.md"
PLUGINS = ("**DDP (today)**", "FSDP", "DeepSpeed", "XLA", "precision", "dynamo", "trackers")
SPECS = {name: fn for name, fn in vars(hookspecs).items()
         if name.startswith("accel_") and callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")}


def sections() -> dict[str, str]:
    """Hook name -> the text of its section (from its `### ` heading to the next heading)."""
    text = DOC.read_text(encoding="utf-8")
    parts = re.split(r"^#{2,3} ", text, flags=re.M)
    found = {}
    for part in parts:
        match = re.match(r"`(accel_\w+)\(", part)
        if match:
            assert match.group(1) not in found, f"{match.group(1)} is documented twice"
            found[match.group(1)] = part
    return found


def test_there_are_hooks_to_document():
    assert len(SPECS) >= 20 and "accel_wrap_model" in SPECS and "accel_launch" in SPECS


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_is_documented_with_its_signature(name):
    section = sections().get(name)
    assert section is not None, f"docs/hooks.md has no `### `{name}(...)` section"
    params = ", ".join(inspect.signature(SPECS[name]).parameters)
    heading = section.splitlines()[0]
    assert heading.startswith(f"`{name}({params})"), f"signature in docs/hooks.md is {heading!r}, expected {name}({params})"
    for word in ("**When:**", "**Who:**", "**Returns:**"):
        assert word in section, f"{name}: no {word}"
    for plugin in PLUGINS:
        assert re.search(rf"^\| {re.escape(plugin)} \|", section, re.M), f"{name}: no row for {plugin}"


def test_who_answers_matches_the_spec():
    for name, section in sections().items():
        if name not in SPECS:
            continue
        firstresult = getattr(SPECS[name], f"{hookspecs.PROJECT}_spec")["firstresult"]
        who = " ".join(section.split("**Who:**", 1)[1][:60].lower().split())
        assert ("first answer wins" in who) == firstresult, f"{name}: 'Who' does not match firstresult={firstresult}"


def test_no_stale_hooks_in_the_doc():
    stale = sorted(set(sections()) - set(SPECS))
    assert not stale, f"docs/hooks.md documents hooks that hookspecs.py does not have: {stale}"
