"""``accel plugins`` and ``accel env``: what is installed and how this machine looks. No torch import."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import itertools
import json
import os
import platform
import re
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from accel.commands.launch import Parser
from accel.config_files import find_default_config, read_config_file
from accel.errors import PluginError, UsageError
from accel.options import known_plugins
from accel.plugins import PluginRecord, Plugins


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def load_plugins(argv: Sequence[str], parser: Parser) -> tuple[Plugins, argparse.Namespace]:
    """Add ``-p no:NAME`` to ``parser``, parse ``argv`` and load the plugins that are not disabled (for the commands
    that only read plugins: ``plugins``, ``env``, ``estimate-memory``)."""
    parser.add_argument(
        "-p",
        dest="blocked",
        action="append",
        default=[],
        metavar="no:NAME",
        help="Disable a plugin: -p no:NAME (repeatable).",
    )
    args = parser.parse_args(list(argv))
    for value in args.blocked:
        if not value.startswith("no:") or not value[3:]:
            raise UsageError(f"-p expects no:NAME to disable a plugin, got {value!r}")
    plugins = Plugins.load(blocked=[v[3:] for v in args.blocked])
    for message in plugins.warnings:
        print(f"accel: warning: {message}", file=sys.stderr)
    plugins.options()  # a plugin whose accel_add_options fails is shown as failed
    return plugins, args


def _status(rec: PluginRecord) -> str:
    return "active" if rec.status == "loaded" else rec.status


def plugins_command(argv: Sequence[str]) -> int:
    parser = Parser(
        prog="accel plugins",
        description="List the built-in plugins and the installed accel plugins (entry-point group 'accel').",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    plugins, args = load_plugins(argv, parser)
    listed = plugins.builtin + plugins.all_records
    rows = [
        {
            "name": r.name,
            "distribution": r.distribution,
            "version": r.version,
            "hooks": r.hooks,
            "provides": r.provides,
            "status": _status(r),
            "reason": r.reason,
            "entry_point": r.value,
        }
        for r in listed
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("accel plugins (entry-point group 'accel')")
    # in a pipe or a file: one line per plugin (no install hint cut in the middle), unless COLUMNS asks for a width
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() or os.environ.get("COLUMNS") else None
    print(_plugins_table(listed, width))
    if not plugins.all_records:
        print("no plugins installed; the kernel trains on one process. Try: pip install accel-plugin-ddp")
    return 0


def _plugins_table(records: Sequence[PluginRecord], width: int | None) -> str:
    """The plugins as plain-text columns ``width`` wide (the terminal's: COLUMNS, else the terminal, else 80). Name
    and version keep their width, hooks wrap between whole names, the status wraps to what is left; the distribution
    folds at its hyphens only when the status would get under 20 columns, and width the status does not need goes
    to the hooks (fewer lines). ``width=None``: one line per plugin, each column as wide as its longest cell, the hooks last."""
    names = ("name", "distribution", "version", "hooks", "status")
    rows = [
        (r.name, r.distribution, r.version, ", ".join(r.hooks), _status(r) + (f": {r.reason}" if r.reason else ""))
        for r in records
    ]
    widths = [max(len(names[i]), *(len(row[i]) for row in rows)) for i in range(5)]
    if width is None:  # the long hooks cell last, so no other column waits behind its padding
        order = (0, 1, 2, 4, 3)
        return "\n".join(
            "  ".join(row[i].ljust(widths[i]) for i in order).rstrip()
            for row in [names, tuple("-" * w for w in widths), *rows]
        )
    widths[3] = max([len(names[3])] + [len(h) + 1 for r in records for h in r.hooks])  # a whole name and its comma
    gaps = 2 * (len(names) - 1)
    wanted = min(20, widths[4])
    if width - gaps - sum(widths[:4]) < wanted:
        parts = [part for row in rows for part in textwrap.wrap(row[1], 1, break_long_words=False)]  # "accel-", ...
        widths[1] = max(len(names[1]), *map(len, parts), widths[1] - (wanted - (width - gaps - sum(widths[:4]))))
    free = width - gaps - sum(widths[:4])
    widths[4] = max(10, min(free, widths[4]))
    widths[3] += max(0, free - widths[4])
    lines = [
        "  ".join(name.ljust(w) for name, w in zip(names, widths, strict=True)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    for row in rows:
        cells = [
            [row[0]],
            textwrap.wrap(row[1], widths[1]),
            [row[2]],
            textwrap.wrap(row[3], widths[3], break_long_words=False, break_on_hyphens=False),
            textwrap.wrap(row[4], widths[4], break_on_hyphens=False),
        ]
        for line in itertools.zip_longest(*cells, fillvalue=""):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _import_of(name: str) -> str:
    """The version and folder of what ``import name`` gives this process, found without importing it (for
    ``accelerate``: Hugging Face's, or accel-accelerate's façade, as its start-up switch decided)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return "not importable"
    return f"{_version(name)} ({os.path.dirname(spec.origin)})"


def _torch_build() -> str:
    """torch version and build from its metadata, without importing it."""
    try:
        version = md.version("torch")
    except md.PackageNotFoundError:
        return "not installed"
    requires = md.requires("torch") or []
    cuda = sorted({r.split("-cu")[1][:2] for r in requires if r.startswith("nvidia-") and "-cu" in r.split(";")[0]})
    if "+" in version:
        build = version.split("+", 1)[1]
    else:
        build = f"cuda {'/'.join(cuda)}" if cuda else "cpu or unknown"
    return f"{version} ({build})"


def _package_versions(plugins: Plugins) -> list[tuple[str, str]]:
    """(package, version or "not installed") for what the installed plugins run on (their distributions'
    requirements, optional ones included, test-only ones left out) and the packages listed under ``env_packages``
    in known_plugins.json, from metadata only: nothing is imported."""
    names: dict[str, None] = {}
    for rec in plugins.all_records:
        try:
            requires = md.requires(rec.distribution) or []
        except md.PackageNotFoundError:  # registered directly, not a distribution
            continue
        for req in requires:
            match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
            if match and not re.search(r"""extra\s*==\s*["'](test|tests|dev|docs)["']""", req):
                names.setdefault(match.group(0).lower().replace("_", "-"), None)
    for name in known_plugins().get("env_packages", []):
        names.setdefault(name, None)
    skip = {"accel-kernel", "torch"}  # shown on lines of their own
    return [(name, _version(name)) for name in sorted(names) if name not in skip]


def _memory_gib() -> str:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 1024**2:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def env_command(argv: Sequence[str]) -> int:
    parser = Parser(prog="accel env", description="Print environment information for bug reports.")
    parser.add_argument("--config_file", "--config-file", default=None, help="report this config file instead")
    plugins, args = load_plugins(argv, parser)
    try:
        answers = [(name, hw) for name, hw in plugins.call_each("accel_detect_hardware", env=os.environ) if hw]
        used = max((hw for _, hw in answers), key=lambda h: h.priority)
        devices = f"{used.name} x{used.device_count}"
    except PluginError as exc:  # a diagnostics command reports, it does not fail
        answers, devices = [], f"detection failed: {' '.join(str(exc).split())}"
    lines: list[tuple[str, Any]] = [
        ("accel-kernel version", _version("accel-kernel")),
        ("Platform", platform.platform()),
        ("Python version", f"{sys.version.split()[0]} ({sys.executable})"),
        ("PyTorch version (build)", _torch_build()),
        ("pluggy version", _version("pluggy")),
        ("import accelerate", _import_of("accelerate")),
        ("CPU cores", os.cpu_count()),
        ("System RAM", _memory_gib()),
        ("Devices (used)", devices),
    ]
    for name, hw in answers:
        details = f" {dict(hw.details)}" if hw.details else ""
        lines.append((f"Devices reported by {name}", f"{hw.name} x{hw.device_count} (priority {hw.priority}){details}"))
    for rec in plugins.all_records:
        lines.append(
            (
                f"Plugin {rec.name}",
                f"{rec.distribution} {rec.version}: {_status(rec)}" + (f" ({rec.reason})" if rec.reason else ""),
            )
        )
    if not plugins.all_records:
        lines.append(("Plugins", "none installed"))
    versions = _package_versions(plugins)
    installed = [f"{name} {version}" for name, version in versions if version != "not installed"]
    missing = [name for name, version in versions if version == "not installed"]
    lines.append(("Backend and related packages", ", ".join(installed) or "none"))
    if missing:
        lines.append(("Not installed", ", ".join(missing)))
    path = args.config_file or find_default_config()
    lines.append(("Config file", str(path) if path else "none (defaults)"))
    print("Copy-and-paste the text below in your bug report.\n")
    for key, value in lines:
        print(f"- `{key}`: {value}")
    if path:
        try:
            data = read_config_file(path)
            for key, value in data.items():
                print(f"\t- {key}: {value}")
        except Exception as exc:  # report, don't fail: this is a diagnostics command
            print(f"\t- (cannot read: {' '.join(str(exc).split())})")
    return 0


__all__ = ["plugins_command", "env_command"]
