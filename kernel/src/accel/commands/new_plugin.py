"""``accel new-plugin NAME --kind KIND``: write a working plugin project of one role (tracker, strategy, precision,
compiler or launcher) from the templates shipped with accel (``accel/templates/<kind>/``), ready for
``pip install -e`` and ``pytest``. No torch import."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from accel.commands.launch import Parser
from accel.errors import UsageError

if TYPE_CHECKING:
    from importlib.abc import Traversable  # importlib.resources.abc from Python 3.11

KINDS = ("tracker", "strategy", "precision", "compiler", "launcher")
KERNEL_REQUIREMENT = "accel-kernel>=0.1.1,<0.2"  # admits this kernel (docs/plugin-api.md, Stability)
MAX_NAME = 64  # the directory accel-plugin-NAME and the module accel_NAME stay far below file-name limits


def template_files(kind: str) -> dict[str, str]:
    """``{relative path with placeholders: text}`` of one template."""
    root = resources.files("accel") / "templates" / kind
    files: dict[str, str] = {}

    def walk(node: Traversable, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".tmpl"):
                files[f"{prefix}{child.name[:-5]}"] = child.read_text(encoding="utf-8")

    walk(root, "")
    return files


def render(name: str, kind: str = "tracker") -> dict[str, str]:
    """The files of a new plugin called ``name``: ``{relative path: text}``."""
    if len(name) > MAX_NAME:
        raise UsageError(f"plugin name is {len(name)} characters long; use at most {MAX_NAME}")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise UsageError(
            f"plugin name {name!r} must start with a lowercase letter and hold only a-z, 0-9 and _ "
            "(it becomes the entry-point name and the module accel_NAME)"
        )
    if kind not in KINDS:
        raise UsageError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    values = {
        "name": name,
        "module": f"accel_{name}",
        "distribution": f"accel-plugin-{name.replace('_', '-')}",
        "title": "".join(part.capitalize() for part in name.split("_")),
        "kernel_requirement": KERNEL_REQUIREMENT,
    }
    return {
        path.replace("__name__", name): string.Template(text).substitute(values)
        for path, text in template_files(kind).items()
    }


def taken(name: str) -> str:
    """Who already uses plugin name ``name`` (an installed plugin's distribution, or a published plugin's), or an
    empty string: a second plugin of that name would shadow it (entry-point names are unique)."""
    from importlib import metadata

    from accel.options import known_plugins
    from accel.plugins import GROUP

    for ep in metadata.entry_points(group=GROUP):
        if ep.name == name:
            dist = getattr(ep.dist, "name", None) or "a distribution"
            return f"the installed plugin {name!r} ({dist})"
    published = known_plugins()["plugins"].get(name)
    return f"the published plugin {name!r} ({published['distribution']})" if published else ""


def write(target: Path, files: dict[str, str]) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"{target} already exists and is not empty; choose another --directory")
    for path, text in sorted(files.items()):
        dest = target / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text, encoding="utf-8")


def new_plugin_command(argv: Sequence[str]) -> int:
    parser = Parser(prog="accel new-plugin", description="Write a new accel plugin project from a template.")
    parser.add_argument("name", help="the plugin's name: entry point NAME, module accel_NAME")
    parser.add_argument("--kind", default="tracker", help=f"the plugin's role: {', '.join(KINDS)} (default: tracker)")
    parser.add_argument(
        "--directory",
        "--dir",
        default=None,
        help="where to write it (default: ./accel-plugin-NAME); must not exist or be empty",
    )
    args = parser.parse_args(list(argv))
    files = render(args.name, args.kind)
    owner = taken(args.name)
    if owner:
        raise UsageError(
            f"plugin name {args.name!r} is taken by {owner}, which a new plugin of that name would shadow; "
            f"choose another name (e.g. my_{args.name})"
        )
    target = Path(args.directory or f"accel-plugin-{args.name.replace('_', '-')}")
    write(target, files)
    print(f"wrote a {args.kind} plugin to {target}/ ({len(files)} files). Next:")
    print(f"  pip install -e {target}      # then `accel plugins` lists {args.name!r}")
    print(f"  pytest {target}/tests        # accel's conformance suite and the plugin's own tests")
    return 0


__all__ = ["new_plugin_command", "render", "template_files"]
