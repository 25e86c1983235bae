"""docs/hooks.md documents every hook of accel/hookspecs.py: a section per hook with its current arguments, its
calling rule and its docstring as it is in hookspecs.py, and says which plugins of this repository answer it.
The page is generated (docs/generate.py, `make docs`); tests/test_generated_docs.py checks it is up to date, these
tests check what the generated page promises, so a broken generator cannot pass either."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from accel import hookspecs

DOC = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"
SPECS = {
    name: fn
    for name, fn in vars(hookspecs).items()
    if name.startswith("accel_") and callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")
}


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
    assert len(SPECS) >= 20 and "accel_prepare_training" in SPECS and "accel_launch" in SPECS


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_is_documented_with_its_signature_and_docstring(name):
    section = sections().get(name)
    assert section is not None, f"docs/hooks.md has no `### `{name}(...)` section (run `make docs`)"
    params = ", ".join(inspect.signature(SPECS[name]).parameters)
    heading = section.splitlines()[0]
    assert heading.startswith(f"`{name}({params})"), (
        f"signature in docs/hooks.md is {heading!r}, expected {name}({params})"
    )
    doc = inspect.getdoc(SPECS[name]) or ""
    for word in ("When:", "Who:"):
        assert word in doc, f"hookspecs.{name}'s docstring does not say {word!r} (the contract says when and who)"
    assert doc in section, f"docs/hooks.md's section of {name} does not hold its docstring verbatim (run `make docs`)"
    implemented = re.search(r"\*\*Implemented by:\*\* (.*)", section)
    if getattr(SPECS[name], f"{hookspecs.PROJECT}_spec").get("warn_on_impl"):
        return  # deprecated (accel.deprecations): answered only by plugins written for an earlier release
    assert implemented and implemented.group(1) != "nobody in this repository.", (
        f"{name}: no plugin of this repository and no kernel default answers it (remove it, or implement it)"
    )


def test_who_answers_matches_the_spec():
    for name, section in sections().items():
        if name not in SPECS:
            continue
        firstresult = getattr(SPECS[name], f"{hookspecs.PROJECT}_spec")["firstresult"]
        who = section.split("**Who answers:**", 1)[1].split(".", 1)[0]
        assert ("first answer wins" in who) == firstresult, f"{name}: 'Who' does not match firstresult={firstresult}"


def test_no_stale_hooks_in_the_doc():
    stale = sorted(set(sections()) - set(SPECS))
    assert not stale, f"docs/hooks.md documents hooks that hookspecs.py does not have: {stale}"


def test_the_table_names_every_hook_in_order():
    rows = re.findall(r"^\| \[`(accel_\w+)`\]", DOC.read_text(encoding="utf-8"), re.M)
    assert rows == list(SPECS), "the who-answers table of docs/hooks.md is not hookspecs.py's hooks in order"
