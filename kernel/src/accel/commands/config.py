"""``accel config``: write, upgrade and show the config file (Accelerate-compatible YAML).

- ``accel config [--config_file PATH]``: questions with arrow-key menus (questionary). The kernel asks about the
  machine, compilation, processes and precision; every plugin adds its own questions through the
  ``accel_config_questions`` hook; a backend whose plugin is not installed is shown with its install command instead
  of being offered. Needs a terminal: without one it fails with one line pointing to ``accel config default``.
- ``accel config default [--mixed_precision M] [--config_file PATH] [--force]``: a config for the detected hardware.
- ``accel config update [--config_file PATH]``: rewrite an older or Accelerate-written file in the current schema.
- ``accel config show [--config_file PATH] [--json] [launch flags]``: the effective settings and where each came from.

No torch import here.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from accel.commands.launch import Parser, add_option_flags, blocked_plugins
from accel.commands.questionnaire import (
    NO_TERMINAL,
    STANDARD_KEYS,
    Questionnaire,
    build_config,
    capability_missing,
    interactive_asker,
    menu,
    questionary_asker,
)
from accel.config_files import (
    default_config_dirs,
    find_default_config,
    migrate_legacy,
    read_config_file,
    validate_config,
)
from accel.errors import UsageError
from accel.options import (
    KERNEL,
    Option,
    Options,
    resolve,
)
from accel.plugins import Plugins


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    """Where ``accel config`` writes when no ``--config_file`` is given: the first of ``default_config_dirs``."""
    return default_config_dirs(env)[0] / "default_config.yaml"


def write_yaml(path: Path, data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> None:
    """Write atomically (a temporary file renamed over the target): a failure leaves the old file as it was and
    is one line naming the place and the fix."""
    import yaml

    text = yaml.safe_dump(dict(data), sort_keys=True, default_flow_style=False)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # a read-only file system refuses the clean-up too: the first error counts
            tmp.unlink(missing_ok=True)
        raise cannot_write(path, exc, env) from None


def check_writable(path: Path, env: Mapping[str, str] | None = None) -> None:
    """Before asking questions: the directory of ``path`` exists or can be made, and a file can be created in it."""
    probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise cannot_write(path, exc, env) from None


def cannot_write(path: Path, exc: OSError, env: Mapping[str, str] | None) -> UsageError:
    home = (env if env is not None else os.environ).get("ACCEL_HOME")
    fix = (
        "set ACCEL_HOME to a writable directory"
        if home and Path(home) in (path.parent, *path.parents)
        else "choose a writable place"
    )
    why = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)
    blocker = next((p for p in path.parents if p.is_file()), None)
    if blocker is not None:
        why = f"{blocker} is a file, not a directory"
    return UsageError(f"cannot write the config file {path}: {why}; {fix}, or pass --config_file PATH")


# ---------------------------------------------------------------------------------------------------------------
# Commands


def config_command(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv and argv[0] in ("default", "update", "show"):
        return {"default": default_command, "update": update_command, "show": show_command}[argv[0]](argv[1:])
    parser = Parser(
        prog="accel config",
        description="Answer questions about this machine and write the config file. "
        "Subcommands: default (no questions), update (upgrade a file), show (effective settings).",
    )
    parser.add_argument(
        "--config_file", "--config-file", default=None, help=f"where to write [default: {default_config_path()}]"
    )
    args = parser.parse_args(argv)
    for stream, name in ((sys.stdin, "standard input"), (sys.stdout, "standard output")):
        if not stream.isatty():
            raise UsageError(NO_TERMINAL.format(stream=name))
    env = dict(os.environ)
    plugins = Plugins.load(env=env)
    path = Path(args.config_file) if args.config_file else default_config_path(env)
    check_writable(path, env)  # before the questions, not after them
    ask = interactive_asker(questionary_asker(), plugins.options())
    questionnaire = Questionnaire(plugins, ask, env)
    try:
        questionnaire.run()
    except KeyboardInterrupt:
        print("accel config: cancelled; nothing was written", file=sys.stderr)
        return 130
    except EOFError:
        raise UsageError("input ended before every question was answered; nothing was written") from None
    write_yaml(path, questionnaire.config_data(), env)
    print(f"accel configuration saved at {path}")
    return 0


def default_config(plugins: Plugins, options: Options, env: Mapping[str, str], mixed_precision: str) -> dict[str, Any]:
    """A config for the detected hardware: all its devices when several are found and a plugin can run several
    processes, else one process (on the CPU when no accelerator is found)."""
    hardware = plugins.detect_hardware(env)
    values: dict[str, Any] = {
        "mixed_precision": options["mixed_precision"].coerce(mixed_precision, "--mixed_precision")
    }
    if hardware.name == "cpu":
        values.update(distributed_type="NO", num_processes=1, cpu=True)
    elif hardware.device_count > 1 and capability_missing(plugins, "distributed", unknown_may_provide=False) is None:
        kind = menu()["multi_device_types"].get(hardware.name, "MULTI_GPU")
        values.update(distributed_type=kind, num_processes=hardware.device_count, gpu_ids="all")
    else:
        values.update(distributed_type="NO", num_processes=1, cpu=False)
    return build_config(options, values)


def default_command(argv: Sequence[str]) -> int:
    env = dict(os.environ)
    plugins = Plugins.load(env=env)
    options = plugins.options()
    parser = Parser(prog="accel config default", description="Write a config for the detected hardware, no questions.")
    parser.add_argument(
        "--config_file", "--config-file", default=None, help=f"where to write [default: {default_config_path(env)}]"
    )
    parser.add_argument(
        "--mixed_precision",
        "--mixed-precision",
        default="no",
        help="no, or a mode a plugin provides (fp16, bf16, fp8, ...) [default: no]",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = parser.parse_args(list(argv))
    path = Path(args.config_file) if args.config_file else default_config_path(env)
    if path.exists() and not args.force:
        raise UsageError(
            f"{path} already exists; pass --force to overwrite it, or --config_file PATH to write elsewhere"
        )
    data = default_config(plugins, options, env, args.mixed_precision)
    if data["mixed_precision"] != "no" and (why := capability_missing(plugins, f"precision:{data['mixed_precision']}")):
        print(f"accel: note: mixed_precision {data['mixed_precision']} {why}", file=sys.stderr)
    write_yaml(path, data, env)
    print(f"accel configuration saved at {path}")
    return 0


def upgrade(data: Mapping[str, Any], options: Options) -> tuple[dict[str, Any], list[str]]:
    """The current-schema form of an older or Accelerate-written config, and what changed (one line each)."""
    new, changes = migrate_legacy(data)
    section = new.get("dynamo_config")
    if (
        isinstance(section, dict)
        and isinstance(section.get("dynamo_backend"), str)
        and section["dynamo_backend"] != section["dynamo_backend"].lower()
    ):
        changes.append(
            f"`dynamo_config.dynamo_backend: {section['dynamo_backend']}` -> "
            f"`{section['dynamo_backend'].lower()}` (torch's name)"
        )
        section["dynamo_backend"] = section["dynamo_backend"].lower()
    for key in [k for k, v in new.items() if v is None]:
        del new[key]
        changes.append(f"removed `{key}: null` (not set)")
    for key, section in new.items():
        if isinstance(section, dict):
            for sub in [k for k, v in section.items() if v is None]:
                del section[sub]
                changes.append(f"removed `{key}.{sub}: null` (not set)")
    for name in STANDARD_KEYS:
        key = options[name].path[0]
        if key not in new:
            new[key] = options[name].default
            changes.append(f"added `{key}: {options[name].default}` (the default)")
    return new, changes


def config_path_for(args_path: str | None, env: Mapping[str, str]) -> Path:
    if args_path:
        return Path(args_path)
    found = find_default_config(env)
    if found is None:
        where = ", ".join(str(d) for d in default_config_dirs(env))
        raise UsageError(
            f"no config file found (looked in {where}); pass --config_file PATH or create one with "
            "`accel config` / `accel config default`"
        )
    return found


def update_command(argv: Sequence[str]) -> int:
    env = dict(os.environ)
    plugins = Plugins.load(env=env)
    options = plugins.options()
    parser = Parser(
        prog="accel config update",
        description="Rewrite a config file (older accel or Accelerate) in the current schema, keeping its values.",
    )
    parser.add_argument(
        "--config_file", "--config-file", default=None, help="the file to update [default: the default config file]"
    )
    args = parser.parse_args(list(argv))
    path = config_path_for(args.config_file, env)
    data = read_config_file(path)
    new, changes = upgrade(data, options)
    validate_config(new, options, plugins.loaded, str(path))  # refuse to write a file that would not load
    if not changes:
        print(f"{path} is already up to date")
        return 0
    for line in changes:
        print(f"  {line}")
    write_yaml(path, new, env)
    print(f"accel configuration updated at {path}")
    return 0


def show_command(argv: Sequence[str]) -> int:
    env = dict(os.environ)
    plugins = Plugins.load(env=env, blocked=blocked_plugins(argv))
    options = plugins.options()
    parser = Parser(
        prog="accel config show",
        allow_abbrev=False,
        description="Print the effective settings (what "
        "`accel launch` would use with these flags) and where each value comes from.",
    )
    parser.add_argument("--config_file", "--config-file", default=None)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("-p", dest="blocked", action="append", default=[], metavar="no:NAME")
    add_option_flags(parser, options)
    args = parser.parse_args(list(argv))
    path = args.config_file or find_default_config(env)
    config: dict[str, Any] = {}
    ignored: list[str] = []
    if path is not None:
        config, ignored = validate_config(read_config_file(path), options, plugins.loaded, str(path))
    flags = {opt.name: getattr(args, opt.name, None) for opt in options if opt.cli}
    values, sources = resolve(options, flags=flags, config=config, env=env)
    rows = [_row(opt, values[opt.name], sources[opt.name], path) for opt in options]
    if args.json:
        print(
            json.dumps(
                {
                    "config_file": str(path) if path else None,
                    "ignored": ignored,
                    "settings": {r["name"]: r for r in rows},
                },
                indent=2,
                default=str,
            )
        )
        return 0
    print(f"config file: {path or 'none (defaults)'}")
    width = max(len(r["key"]) for r in rows)
    for r in rows:
        plugin = "" if r["plugin"] == KERNEL else f"  [plugin {r['plugin']}]"
        print(f"  {r['key']:<{width}}  {json.dumps(r['value'], default=str):<24} {r['source']}{plugin}")
    if ignored:
        print(f"ignored (plugins not installed): {', '.join(ignored)}")
    return 0


def _row(opt: Option, value: Any, source: str, path: str | os.PathLike[str] | None) -> dict[str, Any]:
    where = f"file {path}" if source == "file" else source
    return {"name": opt.name, "key": opt.dotted, "value": value, "source": where, "plugin": opt.plugin}


__all__ = ["config_command", "Questionnaire", "build_config", "upgrade", "default_config_path"]
