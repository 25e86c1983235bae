"""known_plugins.json agrees with the plugins of this repository: each plugin's ``provides`` in the file is exactly
what its component classes (``accel_components``) declare, and the file lists every plugin of ``plugins/``."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest
import tomllib

from accel.options import known_plugins
from accel.plugins import GROUP, component_classes

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


def repository_plugins() -> dict[str, str]:
    """Entry-point name -> distribution, for every plugin directory of this repository."""
    found = {}
    for project in sorted(PLUGINS.glob("*/pyproject.toml")):
        meta = tomllib.loads(project.read_text())["project"]
        for name in meta["entry-points"][GROUP]:
            found[name] = meta["name"]
    return found


def test_the_file_lists_every_plugin_of_the_repository() -> None:
    listed = {name: info["distribution"] for name, info in known_plugins()["plugins"].items()}
    assert listed == repository_plugins()


@pytest.mark.parametrize("name", sorted(repository_plugins()))
def test_provides_in_the_file_is_what_the_components_declare(name: str) -> None:
    (entry,) = [ep for ep in md.entry_points(group=GROUP) if ep.name == name]
    module = entry.load()
    classes = component_classes(module)
    assert len(classes) == len(getattr(module, "accel_components", ())), f"a component class of {name} did not import"
    declared = {cap for cls in classes for cap in cls.provides}
    listed = set(known_plugins()["plugins"][name]["provides"])
    assert listed == declared, (
        f"known_plugins.json lists {sorted(listed - declared)} that {name} does not provide, and misses "
        f"{sorted(declared - listed)} that it does"
    )
