"""``accel``: launch, plugins, env. User mistakes are printed as one line with exit code 2, never a traceback.

The commands are a table (:data:`COMMANDS`), not a hook: ``accel --help`` and an unknown command's did-you-mean
read the table alone, and a command's module is imported only when that command runs, so neither plugins nor
torch are imported to list or pick a command (see docs/design.md, "Built-in plugins and one launch plan").
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Sequence

from accel.commands.guard import run_guarded
from accel.errors import UsageError

#: The commands: name, ``"module:function"`` taking the command's arguments and returning its exit code, help.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("launch", "accel.commands.launch:launch", "run a training script on one or many processes/machines (accel launch --help)"),
    ("plugins", "accel.commands.info:plugins_command", "list installed plugins: name, distribution, version, hooks, status (--json)"),
    ("env", "accel.commands.info:env_command", "versions, platform, devices, plugins and config file, ready to paste in a bug report"),
    ("config", "accel.commands.config:config_command", "write the config file: questions, or `config default`; also `config update`, `config show`"),
    ("test", "accel.commands.test_cmd:test_command", "run a short real check of the installation with the current config (accel test -n 2)"),
    ("new-plugin", "accel.commands.new_plugin:new_plugin_command", "write a new plugin project (tracker, strategy, precision, compiler or launcher: --kind) from a template, with its tests"),
    ("estimate-memory", "accel.commands.estimate_memory:estimate_memory_command", "per-process training memory of a model under each installed strategy (--json)"),
)  # fmt: skip

USAGE = (
    "usage: accel <command> [options]\n\ncommands:\n"
    + "".join(f"  {name:<10} {'' if len(name) <= 10 else ' '}{text}\n" for name, _, text in COMMANDS)
    + "\noptions:\n  -h, --help     show this message\n  --version      print accel's version\n"
)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if args[0] == "--version":
        from accel.version import kernel_version

        print(f"accel {kernel_version()}")
        return 0
    command, rest = args[0], args[1:]
    for name, target, _ in COMMANDS:
        if name == command:
            module, _, function = target.partition(":")
            return run_guarded(functools.partial(getattr(importlib.import_module(module), function), rest))
    from accel.options import did_you_mean

    hint = did_you_mean(command, [name for name, _, _ in COMMANDS])
    return run_guarded(lambda: _unknown(command, hint))


def _unknown(command: str, hint: str) -> int:
    raise UsageError(f"unknown command {command!r}{hint} (see `accel --help`)")


if __name__ == "__main__":
    sys.exit(main())
