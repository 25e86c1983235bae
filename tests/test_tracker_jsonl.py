"""accel-plugin-jsonl: the zero-dependency JSON-lines tracker, which is exactly what ``accel new-plugin jsonl``
writes."""

from __future__ import annotations

from pathlib import Path

from accel.commands.new_plugin import render

PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "jsonl"


def without_release_metadata(pyproject: str) -> str:
    """A pyproject.toml without the lines the repository's release policy sets in each of its distributions (version,
    authors, [project.urls]; docs/plugin-api.md, "Stability"), which a generated plugin's author fills in."""
    head, _, rest = pyproject.partition("\n[project.urls]\n")
    if rest:
        head += "\n" + rest.partition("\n\n")[2]
    return "".join(line for line in head.splitlines(keepends=True) if not line.startswith(("version = ", "authors = ")))


def test_plugin_is_the_rendered_template() -> None:
    """plugins/jsonl is the template's output, byte for byte but for its release metadata: re-render it after
    changing the template."""
    expected = render("jsonl", "tracker")
    found = {
        str(p.relative_to(PLUGIN)): p.read_text()
        for p in PLUGIN.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)
    }
    for files in (expected, found):
        files["pyproject.toml"] = without_release_metadata(files["pyproject.toml"])
    assert found == expected
