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
from collections.abc import Mapping, Sequence
from typing import Any

from accel.config_files import (
    find_accelerate_config,
    find_default_config,
    migrate_legacy,
    read_config_file,
    validate_config,
)
from accel.contract import LaunchPlan
from accel.deprecations import deprecated_hooks_note
from accel.errors import UsageError
from accel.options import Options, did_you_mean, install_hint, known_plugins
from accel.planning import activate_plan, resolve_plan
from accel.plugins import Plugins

#: Settings whose default is announced when no config file is used (as Accelerate does).
ANNOUNCED = ("num_processes", "num_machines", "mixed_precision", "dynamo_backend")


#: Words a boolean flag takes as its value (``--fsdp_offload_params true``, Accelerate's spelling).
BOOL_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) instead of usage + error, Accelerate's ``--flag true/false`` for
    boolean flags, and a specific message for the Accelerate flags accel refuses."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        parsed, extra = self.parse_known_args(self.normalize(argv), namespace)
        if extra:
            word = extra[0].split("=", 1)[0]
            refused = refused_flag(word)
            if refused:
                raise UsageError(f"{word}: {refused}")
            flags = [flag for action in self._actions for flag in action.option_strings]
            self.error(f"unrecognized argument {extra[0]!r}{did_you_mean(word, flags)}")
        return parsed

    def normalize(self, argv: list[str]) -> list[str]:
        """Give every boolean flag before the script its value with ``=`` (``--cpu`` -> ``--cpu=true``,
        ``--cpu false`` -> ``--cpu=false``), so its optional value can never swallow the script's name."""
        out: list[str] = []
        i = 0
        while i < len(argv):
            token = argv[i]
            if token == "--" or not token.startswith("-") or token == "-":
                return out + argv[i:]  # the script and its arguments
            flag, eq, _ = token.partition("=")
            action = self._option_string_actions.get(flag)
            if action is not None and getattr(action, "boolean", False) and not eq:
                following = argv[i + 1] if i + 1 < len(argv) else ""
                if following.lower() in BOOL_WORDS:
                    token, i = f"{flag}={following}", i + 1
                else:
                    token = f"{flag}=true"
            elif action is not None and action.nargs is None and not eq and i + 1 < len(argv):
                out.append(token)
                token, i = argv[i + 1], i + 1  # its value, whatever it looks like
            out.append(token)
            i += 1
        return out


class BoolFlag(argparse.Action):
    """A boolean flag: bare, ``=VALUE`` or ``VALUE`` (true/false, yes/no, on/off, 1/0)."""

    boolean = True

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("metavar", "true|false")
        super().__init__(option_strings, dest, nargs="?", const="true", **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


class SelectPlugin(BoolFlag):
    """Accelerate's ``--use_deepspeed``-style flag: the same as ``--plugin NAME`` (when true)."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, plugin: str = "", installed: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.plugin, self.installed = plugin, installed

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if str(values).lower() not in BOOL_WORDS:
            raise UsageError(f"{option_string} expects true or false, got {values!r}")
        if str(values).lower() in ("false", "no", "off", "0"):
            return
        if not self.installed:
            raise UsageError(
                f"{option_string} selects plugin {self.plugin!r}, which is not installed; install it "
                f"with `{install_hint(self.plugin)}`"
            )
        chosen = getattr(namespace, "plugins", None) or []
        namespace.plugins = chosen if self.plugin in chosen else [*chosen, self.plugin]


class Refuse(argparse.Action):
    """An Accelerate flag accel does not take: one line saying why and what to use."""

    def __init__(self, option_strings: Sequence[str], dest: str, message: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs="?", help=argparse.SUPPRESS)
        self.message = message

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        raise UsageError(f"{option_string}: {self.message}")


def refused_flag(flag: str) -> str:
    """The message for an Accelerate flag accel refuses (exact name or ``prefix*``), or an empty string."""
    name = flag.lstrip("-").replace("-", "_")
    for pattern, message in known_plugins()["accelerate_launch_flags"]["refused"].items():
        if name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])):
            return str(message)
    return ""


def spellings(name: str) -> list[str]:
    return [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])


def add_accelerate_flags(parser: argparse.ArgumentParser, plugins: Plugins) -> None:
    """Accelerate's launch flags that are not accel options: plugin selections, negations, refusals, and the
    flags of published plugins that are not installed or cannot be loaded here (each says how to get it)."""
    table = known_plugins()
    taken = parser._option_string_actions

    def free(name: str) -> list[str]:
        return [s for s in spellings(name) if s not in taken]

    accelerate = table["accelerate_launch_flags"]
    for flag, plugin in accelerate["select"].items():
        if free(flag):
            parser.add_argument(
                *free(flag),
                dest="select_" + flag,
                action=SelectPlugin,
                plugin=plugin,
                installed=plugin in plugins.records,
                help=f"Same as --plugin {plugin} (Accelerate's flag).",
            )
    for flag, target in accelerate["negate"].items():
        action = taken.get(f"--{target}")
        if action is not None and free(flag):
            parser.add_argument(
                *free(flag), dest=action.dest, action="store_const", const="false", help=f"Same as --{target} false."
            )
    for flag, message in accelerate["refused"].items():
        if not flag.endswith("*") and free(flag):
            parser.add_argument(*free(flag), action=Refuse, message=message)
    for plugin, info in table["plugins"].items():
        rec = plugins.records.get(plugin)
        if rec is not None and rec.status in ("loaded", "unavailable"):
            continue  # its own options are declared (an unavailable plugin refuses them when they are set)
        why = (
            f"which is installed but {rec.status}: {rec.reason}"
            if rec is not None
            else f"which is not installed; install it with `pip install {info['distribution']}`"
        )
        for flag in info.get("launch_flags", []):
            if free(flag):
                parser.add_argument(*free(flag), action=Refuse, message=f"an option of plugin {plugin!r}, {why}")


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
        elif opt.modes:
            help_text += f" {{{', '.join(['no', *opt.modes.known()])}}}"
        if opt.type == "bool":
            group.add_argument(*names, dest=opt.name, action=BoolFlag, default=None, help=help_text)
        elif opt.type == "list":
            group.add_argument(*names, dest=opt.name, action="append", default=None, metavar="NAME", help=help_text)
        else:
            group.add_argument(*names, dest=opt.name, default=None, metavar=opt.type.upper(), help=help_text)


def build_parser(options: Options, prog: str = "accel launch", plugins: Plugins | None = None) -> Parser:
    parser = Parser(
        prog=prog, allow_abbrev=False, description="Launch a training script on one or many processes and machines."
    )
    parser.add_argument(
        "--config_file", "--config-file", default=None, help="YAML config (Accelerate's keys accepted)."
    )
    parser.add_argument(
        "-p",
        dest="blocked",
        action="append",
        default=[],
        metavar="no:NAME",
        help="Disable a plugin: -p no:NAME (repeatable).",
    )
    parser.add_argument("-m", "--module", action="store_true", help="Run the script as a module (python -m).")
    parser.add_argument("--no_python", "--no-python", action="store_true", help="Run the script as an executable.")
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="Print the resolved plan (active plugins, settings that differ from their defaults, launcher "
        "command, environment) and exit.",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="With --dry-run: list every setting and which plugin answers each hook."
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="No notices.")
    add_option_flags(parser, options)
    if plugins is not None:
        add_accelerate_flags(parser, plugins)
    parser.add_argument("training_script", nargs="?", help="The script to run (or module with -m).")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="Arguments of the script.")
    return parser


def plan_launch(argv: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[Plugins, LaunchPlan, list[str]]:
    """Resolve everything ``accel launch`` needs; raise ``UsageError`` on bad input before anything is printed,
    started or written. Returns the plugins, the plan, and the notices to print (one line each)."""
    env = dict(os.environ if env is None else env)
    notices: list[str] = []
    blocked = blocked_plugins(argv)
    plugins = Plugins.load(env=env, blocked=blocked)
    options = plugins.options()
    args = build_parser(options, plugins=plugins).parse_args(argv)
    for value in args.blocked:
        if not value.startswith("no:") or not value[3:]:
            raise UsageError(
                f"-p expects no:NAME to disable a plugin, got {value!r}; select plugins with --plugin NAME"
            )
    if not args.training_script:
        raise UsageError("no training script given: accel launch [options] script.py [script args]")
    path = args.config_file
    if path is None:
        found = find_default_config(env)
        if found is not None:
            path = str(found)
            notices.append(f"using the default config file {path} (--config_file FILE picks another)")
        elif (found := find_accelerate_config(env)) is not None:
            path = str(found)
            notices.append(
                f"using Accelerate's default config file {path}, as accel has none of its own "
                "(--config_file FILE picks another; `accel config` writes accel's)"
            )
    config: dict[str, Any] = {}
    if path is not None:
        data, legacy = migrate_legacy(read_config_file(path))
        if legacy:
            notices.append(
                f"read old Accelerate keys of {path}: {'; '.join(legacy)} (`accel config update` rewrites the file)"
            )
        config, ignored = validate_config(data, options, plugins.loaded, path, plugins.unavailable())
        if ignored:
            notices.append(f"ignoring config keys: {'; '.join(ignored)}")
    flags = {opt.name: getattr(args, opt.name, None) for opt in options if opt.cli}
    values, sources = resolve_plan(plugins, env, flags=flags, config=config, notices=notices)
    script = args.training_script
    if not (args.module or args.no_python) and not os.path.isfile(script):
        raise UsageError(f"training script {script!r} does not exist")
    settings = activate_plan(plugins, values, sources, env)
    defaults = [n for n in ANNOUNCED if sources[n] in ("default", "hardware")]
    if path is None and defaults:
        listed = ", ".join(f"`--{n}` was set to a value of `{values[n]!r}`" for n in defaults)
        notices.append(
            f"these values were not given, so defaults were used: {listed} "
            "(pass them or use a config file to silence this)"
        )
    for rec in plugins.failed:
        notices.append(f"plugin {rec.name!r} ({rec.distribution} {rec.version}) is skipped: {rec.reason}")
    taking_part = {c.name for c in plugins.components}
    for rec in plugins.all_records:  # a deprecated hook that takes effect in this run (as `accel plugins` says)
        if rec.name in taking_part and (note := deprecated_hooks_note(rec.hooks)):
            notices.append(f"plugin {rec.name!r} ({rec.distribution} {rec.version}) uses a deprecated hook: {note}")
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
    plan = LaunchPlan(
        settings=settings, command=command, env=env, python=python, dry_run=args.dry_run, verbose=args.verbose
    )
    return plugins, plan, [] if args.quiet else notices


def print_plan(plugins: Plugins, plan: LaunchPlan) -> None:
    print("accel launch plan (dry run: nothing is started)")
    comps = ", ".join(f"{c.name} ({c.role})" for c in plugins.components) or "none (kernel only)"
    print(f"active plugins: {comps}")
    shown = sorted(plan.settings.values.items())
    if plan.verbose:
        print("settings (value, where it came from):")
    else:
        shown = [(k, v) for k, v in shown if plan.settings.sources.get(k, "default") != "default"]
        hidden = len(plan.settings.values) - len(shown)
        print(f"settings (value, where it came from; {hidden} more at their defaults, --verbose lists them):")
    for key, value in shown:
        print(f"  {key} = {value!r} ({plan.settings.sources.get(key, '?')})")
    if not plan.verbose:
        return  # the hook table is for plugin authors
    print("hooks (who answers; 'accel' and 'accel.*' are built-in plugins):")
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
    from accel.commands.guard import run_guarded

    return run_guarded(lambda: launch(list(sys.argv[1:] if argv is None else argv)))


def launch(argv: list[str]) -> int:
    from accel.processes import start_up_objects

    before = dict(os.environ)
    with start_up_objects():  # the plan lives until the launch ends: nothing for the garbage collector to free
        plugins, plan, notices = plan_launch(argv, before)
    for message in plugins.warnings:
        print(f"accel: warning: {message}", file=sys.stderr)
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
