"""docs/writing-plugins.md stays true: its code is the templates' code (which test_plugin_template.py installs
and tests), and its example training script runs and logs through the plugin it builds."""

from __future__ import annotations

import json
import re
from pathlib import Path

from accel.commands.new_plugin import render
from accel.testing import run_launch

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-plugins.md"
#: The plugin of each role the walk-through builds: (kind, name).
WALKTHROUGH = [
    ("tracker", "jsonl"),
    ("strategy", "avgdp"),
    ("precision", "half"),
    ("compiler", "fxpass"),
    ("launcher", "procs"),
]
BLOCK = re.compile(r"<!-- template: (\w+) (\w+) (\S+) -->\n```\w*\n(.*?)```", re.S)


def test_every_file_shown_is_the_template_output_and_every_file_is_shown() -> None:
    text = DOC.read_text()
    shown = {(kind, name, path): body for kind, name, path, body in BLOCK.findall(text)}
    assert {(k, n) for k, n, _ in shown} == set(WALKTHROUGH)
    for (kind, name, path), body in shown.items():
        assert body == render(name, kind)[path], f"{path} in {DOC.name} differs from `accel new-plugin {name}`"
    for kind, name in WALKTHROUGH:
        missing = {p for p in render(name, kind) if p not in ("README.md", "LICENSE")} - {
            p for k, n, p in shown if n == name
        }
        assert not missing, f"the walk-through does not show {sorted(missing)}"


def test_the_example_script_logs_through_the_tracker(tmp_path: Path) -> None:
    script = re.search(r"<!-- example: train.py -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert script is not None
    (tmp_path / "train.py").write_text(script.group(1))
    run_launch(["train.py"], num_processes=1, registered=["jsonl"], home=tmp_path / "home", cwd=tmp_path)
    events = [json.loads(line) for line in (tmp_path / "out" / "jsonl" / "demo.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["init"] + ["log"] * 5 + ["end"]
    assert events[0]["config"] == {"lr": 0.1} and [e["step"] for e in events[1:6]] == [0, 1, 2, 3, 4]


def test_every_attribute_of_every_conformance_suite_is_in_the_table() -> None:
    """The table of "The conformance suites: what you set" names, for each suite, everything it reads from a
    subclass (its public attributes and methods, ``test_*`` aside)."""
    from accel.testing import conformance

    section = DOC.read_text().split("## The conformance suites: what you set\n")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    suites = [
        conformance.TrackerConformance,
        conformance.StrategyConformance,
        conformance.PrecisionConformance,
        conformance.CompilerConformance,
        conformance.LauncherConformance,
    ]
    for suite in suites:
        documented = {
            name
            for who, what, *_ in rows
            if who == "| every suite" or f"`{suite.__name__}`" in who
            for name in re.findall(r"`(\w+)", what)
        }
        public = {a for a in dir(suite) if not a.startswith(("_", "test_"))}
        assert public <= documented, f"{suite.__name__}: {sorted(public - documented)} not in the table"


def test_what_the_docs_tell_plugins_to_import_is_importable_from_the_plugin_api() -> None:
    """CHANGELOG, plugin-api.md, this guide and the templates name kernel names the way a plugin imports them:
    every ``accel.spi...`` name exists there, and none is given from ``accel.contract`` (plugins may not import it)."""
    import importlib

    root = DOC.parents[1]
    texts = [root / "CHANGELOG.md", root / "docs" / "plugin-api.md", DOC]
    texts += sorted((root / "kernel" / "src" / "accel" / "templates").rglob("*.tmpl"))
    for path in texts:
        text = path.read_text(encoding="utf-8")
        assert "accel.contract" not in text, f"{path.name} names accel.contract, which plugins may not import"
        for dotted in set(re.findall(r"\baccel\.spi(?:\.\w+)+", text)):
            module, *rest = dotted.split(".")[2:]
            try:
                found: object = importlib.import_module(f"accel.spi.{module}")
            except ModuleNotFoundError:
                found = getattr(importlib.import_module("accel.spi"), module, None)
            for name in rest:
                found = getattr(found, name, None)
            assert found is not None, f"{path.name} names {dotted}, which accel.spi does not have"
