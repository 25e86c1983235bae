"""Hide installed accel plugins from entry-point discovery, for tests that must see an exact set of plugins.

importlib.metadata keeps the *first* distribution of a name found on ``sys.path``. A directory of empty
``accel-plugin-NAME`` distributions (metadata only, no entry points) put first on ``sys.path`` / ``PYTHONPATH``
therefore hides the real ones, which then count as "not installed" — whatever the developer's or CI's venv has.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from accel.options import known_plugins


def hide_plugins(directory: Path, keep: Iterable[str] = ("ddp",)) -> Path:
    """Write empty distributions into ``directory`` for every published plugin and every installed distribution with
    an accel plugin (accel-accelerate's ``accelerate-names``, a third party's), except the plugins named in ``keep``;
    return it."""
    import importlib.metadata as md

    from accel.plugins import GROUP

    keep = set(keep)
    directory.mkdir(parents=True, exist_ok=True)
    hidden = {info["distribution"] for name, info in known_plugins()["plugins"].items() if name not in keep}
    hidden |= {str(ep.dist.metadata["Name"]) for ep in md.entry_points(group=GROUP) if ep.dist and ep.name not in keep}
    for dist in sorted(hidden):
        meta = directory / f"{dist.replace('-', '_')}-0.0.0.dist-info"
        meta.mkdir(exist_ok=True)
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.0\n", encoding="utf-8")
    return directory
