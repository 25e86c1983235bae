"""``accel plugins`` and ``accel env``: what is installed and how this machine looks. No torch import."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import sys
from typing import Any, Sequence

from accel.commands.launch import Parser
from accel.options import find_default_config, read_config_file
from accel.plugins import Plugins


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def plugins_command(argv: Sequence[str]) -> int:
    parser = Parser(prog="accel plugins", description="List installed accel plugins.")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(list(argv))
    plugins = Plugins.load()
    rows = [r.as_dict() for r in plugins.records.values()]
    for row in rows:
        row["status"] = "active" if row["status"] == "loaded" else row["status"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="accel plugins (entry-point group 'accel')")
    for column in ("name", "distribution", "version", "hooks", "status"):
        table.add_column(column, overflow="fold")
    for row in rows:
        status = row["status"] + (f": {row['reason']}" if row["reason"] else "")
        table.add_row(row["name"], row["distribution"], row["version"], ", ".join(row["hooks"]), status)
    if not rows:
        print("no plugins installed; the kernel trains on one process. Try: pip install accel-plugin-ddp")
        return 0
    Console(width=max(120, Console().width)).print(table)
    return 0


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
    parser.add_argument("--config_file", "--config-file", default=None)
    args = parser.parse_args(list(argv))
    plugins = Plugins.load()
    hw = plugins.detect_hardware()
    lines: list[tuple[str, Any]] = [
        ("accel-kernel version", _version("accel-kernel")),
        ("Platform", platform.platform()),
        ("Python version", sys.version.split()[0]),
        ("PyTorch version (build)", _torch_build()),
        ("pluggy version", _version("pluggy")),
        ("CPU cores", os.cpu_count()),
        ("System RAM", _memory_gib()),
        ("Hardware (detected)", f"{hw.name} x{hw.device_count}" + (f" {dict(hw.details)}" if hw.details else "")),
    ]
    for rec in plugins.records.values():
        status = "active" if rec.status == "loaded" else rec.status
        lines.append((f"plugin {rec.name}", f"{rec.distribution} {rec.version}: {status}"
                      + (f" ({rec.reason})" if rec.reason else "")))
    if not plugins.records:
        lines.append(("plugins", "none installed"))
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
            print(f"\t- (cannot read: {exc})")
    return 0


__all__ = ["plugins_command", "env_command"]
