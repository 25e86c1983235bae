"""``accel launch``: resolve settings (flags > environment > config file > defaults), activate the plugins for the
planned run, and hand the workers to the plugin that launches (torchrun for DDP; one process by default).

``python -m accel.commands.launch ...`` is the same as ``accel launch ...``. No torch import before launching.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any, Mapping, Sequence

from accel.contract import LaunchPlan
from accel.errors import UsageError
from accel.options import (
    Options,
    Settings,
    did_you_mean,
    find_default_config,
    migrate_legacy,
    read_config_file,
    resolve,
    validate_config,
)
from accel.plugins import Plugins

#: Settings whose default is announced when no config file is used (as Accelerate does).
ANNOUNCED = ("num_processes", "num_machines", "mixed_precision", "dynamo_backend")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            flags = [flag for action in self._actions for flag in action.option_strings]
            word = extra[0].split("=", 1)[0]
            self.error(f"unrecognized argument {extra[0]!r}{did_you_mean(word, flags)}")
        return parsed


def blocked_plugins(argv: Sequence[str]) -> list[str]:
    """``-p no:NAME`` values, read before plugins load (so a disabled plugin is never imported). Stops at the
    script (the first ``*.py`` argument) so the script's own arguments are left alone."""
    names = []
    for i, arg in enumerate(argv):
        if arg == "--" or arg.endswith(".py"):
            break
        value = argv[i + 1] if arg == "-p" and i + 1 < len(argv) else arg[2:] if arg.startswith("-p") else ""
        if value.startswith("no:"):
            names.append(value[3:])
    return names


def add_option_flags(parser: argparse.ArgumentParser, options: Options) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for opt in options:
        if not opt.cli:
            continue
        group = groups.get(opt.plugin)
        if group is None:
            title = "launch options" if opt.plugin == "accel" else f"plugin {opt.plugin!r}"
            group = groups[opt.plugin] = parser.add_argument_group(title)
        names = [f for f in opt.flags if f.startswith("--")] + [f"--{opt.name}"]  # `--plugin` before `--plugins`
        if "_" in opt.name:
            names.append(f"--{opt.name.replace('_', '-')}")
        names += [f for f in opt.flags if f not in names]
        help_text = opt.help + (f" [default: {opt.default}]" if opt.default not in (None, [], "") else "")
        if opt.choices:
            help_text += f" {{{', '.join(opt.choices)}}}"
        if opt.type == "bool":
            group.add_argument(*names, dest=opt.name, action="store_const", const="true", default=None, help=help_text)
        elif opt.type == "list":
            group.add_argument(*names, dest=opt.name, action="append", default=None, metavar="NAME", help=help_text)
        else:
            group.add_argument(*names, dest=opt.name, default=None, metavar=opt.type.upper(), help=help_text)


def build_parser(options: Options, prog: str = "accel launch") -> Parser:
    parser = Parser(prog=prog, allow_abbrev=False,
                    description="Launch a training script on one or many processes and machines.")
    parser.add_argument("--config_file", "--config-file", default=None, help="YAML config (Accelerate's keys accepted).")
    parser.add_argument("-p", dest="blocked", action="append", default=[], metavar="no:NAME",
                        help="Disable a plugin: -p no:NAME (repeatable).")
    parser.add_argument("-m", "--module", action="store_true", help="Run the script as a module (python -m).")
    parser.add_argument("--no_python", "--no-python", action="store_true", help="Run the script as an executable.")
    parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                        help="Print the resolved plan (plugins per hook, launcher command, environment) and exit.")
    parser.add_argument("-q", "--quiet", action="store_true", help="No notices.")
    add_option_flags(parser, options)
    parser.add_argument("training_script", nargs="?", help="The script to run (or module with -m).")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="Arguments of the script.")
    return parser


def check(values: dict[str, Any]) -> None:
    """Checks that need several values at once (single values were checked by their Option)."""
    if values["machine_rank"] >= values["num_machines"]:
        raise UsageError(f"--machine_rank {values['machine_rank']} is out of range for --num_machines "
                         f"{values['num_machines']} (ranks go from 0 to {values['num_machines'] - 1})")
    if values["num_processes"] % values["num_machines"]:
        raise UsageError(f"--num_processes {values['num_processes']} is not a multiple of --num_machines "
                         f"{values['num_machines']} (num_processes counts the processes of all machines)")
    if values["num_machines"] > 1 and not values["main_process_ip"]:
        raise UsageError("a run on several machines needs --main_process_ip (the address of the machine of rank 0)")
    if values["compute_environment"] != "LOCAL_MACHINE":
        raise UsageError(f"compute_environment {values['compute_environment']} is not supported; use LOCAL_MACHINE")


def plan_launch(argv: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[Plugins, LaunchPlan, list[str]]:
    """Resolve everything ``accel launch`` needs; raise ``UsageError`` on bad input before anything is printed,
    started or written. Returns the plugins, the plan, and the notices to print (one line each)."""
    env = dict(os.environ if env is None else env)
    notices: list[str] = []
    blocked = blocked_plugins(argv)
    plugins = Plugins.load(env=env, blocked=blocked)
    options = plugins.options()
    args = build_parser(options).parse_args(argv)
    for value in args.blocked:
        if not value.startswith("no:") or not value[3:]:
            raise UsageError(f"-p expects no:NAME to disable a plugin, got {value!r}; select plugins with --plugin NAME")
    if not args.training_script:
        raise UsageError("no training script given: accel launch [options] script.py [script args]")
    path = args.config_file
    if path is None:
        found = find_default_config(env)
        if found is not None:
            path = str(found)
            notices.append(f"using the default config file {path} (--config_file FILE picks another)")
    config: dict[str, Any] = {}
    if path is not None:
        data, legacy = migrate_legacy(read_config_file(path))
        if legacy:
            notices.append(f"read old Accelerate keys of {path}: {'; '.join(legacy)} "
                           "(`accel config update` rewrites the file)")
        config, ignored = validate_config(data, options, plugins.loaded, path, plugins.unavailable())
        if ignored:
            notices.append(f"ignoring config keys: {'; '.join(ignored)}")
    flags = {opt.name: getattr(args, opt.name, None) for opt in options if opt.cli}
    values, sources = resolve(options, flags=flags, config=config, env=env)
    if values["multi_gpu"] and sources["num_processes"] == "default":
        values["num_processes"] = max(1, plugins.detect_hardware(env).device_count)
        sources["num_processes"] = "hardware"
    check(values)
    script = args.training_script
    if not (args.module or args.no_python) and not os.path.isfile(script):
        raise UsageError(f"training script {script!r} does not exist")
    settings = Settings(values, sources, world_size=values["num_processes"], phase="launch", env=env)
    plugins.activate(settings)
    defaults = [n for n in ANNOUNCED if sources[n] in ("default", "hardware")]
    if path is None and defaults:
        listed = ", ".join(f"`--{n}` was set to a value of `{values[n]!r}`" for n in defaults)
        notices.append(f"these values were not given, so defaults were used: {listed} "
                       "(pass them or use a config file to silence this)")
    for rec in plugins.failed:
        notices.append(f"plugin {rec.name!r} ({rec.distribution} {rec.version}) is skipped: {rec.reason}")
    handed = {k: v for k, v in values.items() if sources[k] != "default"}
    env["ACCEL_CONFIG"] = json.dumps(handed, sort_keys=True)
    if blocked:
        already = [p for p in env.get("ACCEL_DISABLE_PLUGINS", "").split(",") if p]
        env["ACCEL_DISABLE_PLUGINS"] = ",".join(sorted(set(already + blocked)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.no_python:
        command = [script, *args.training_script_args]
        python = ""
    else:
        command = (["-m", script] if args.module else [script]) + list(args.training_script_args)
        python = sys.executable
    plan = LaunchPlan(settings=settings, command=command, env=env, python=python, dry_run=args.dry_run)
    return plugins, plan, [] if args.quiet else notices


def print_plan(plugins: Plugins, plan: LaunchPlan) -> None:
    print("accel launch plan (dry run: nothing is started)")
    comps = ", ".join(f"{c.name} ({c.role})" for c in plugins.components) or "none (kernel only)"
    print(f"active plugins: {comps}")
    print("settings (value, where it came from):")
    for key, value in sorted(plan.settings.values.items()):
        print(f"  {key} = {value!r} ({plan.settings.sources.get(key, '?')})")
    print("hooks (who answers; 'accel' is the kernel's default):")
    for hook, (firstresult, who) in plugins.answer_order().items():
        if not who:
            print(f"  {hook}: -")
        elif firstresult:
            rest = f" (then {', '.join(who[1:])})" if len(who) > 1 else ""
            print(f"  {hook}: {who[0]}{rest}")
        else:
            print(f"  {hook}: each of {', '.join(who)}")


def print_env(env: Mapping[str, str], before: Mapping[str, str]) -> None:
    """The environment variables the workers get on top of the caller's environment."""
    print("environment for the workers (added to or changed from yours):")
    changed = sorted(k for k in env if before.get(k) != env[k])
    for key in changed:
        print(f"  {key}={shlex.quote(env[key])}")
    for key in sorted(k for k in before if k not in env):
        print(f"  unset {key}")


def main(argv: Sequence[str] | None = None) -> int:
    from accel.commands.cli import run_guarded

    return run_guarded(lambda: launch(list(sys.argv[1:] if argv is None else argv)))


def launch(argv: list[str]) -> int:
    before = dict(os.environ)
    plugins, plan, notices = plan_launch(argv, before)
    for message in notices:
        print(f"accel: {message}", file=sys.stderr)
    if not plan.dry_run:
        return int(plugins.pm.hook.accel_launch(plan=plan) or 0)
    print_plan(plugins, plan)
    code = int(plugins.pm.hook.accel_launch(plan=plan) or 0)  # prints the exact launcher command
    print_env(plan.env, before)
    return code


if __name__ == "__main__":
    sys.exit(main())
