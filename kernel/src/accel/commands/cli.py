"""``accel``: launch, plugins, env. User mistakes are printed as one line with exit code 2, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from accel.commands.guard import run_guarded
from accel.errors import UsageError

USAGE = """usage: accel <command> [options]

commands:
  launch     run a training script on one or many processes/machines (accel launch --help)
  plugins    list installed plugins: name, distribution, version, hooks, status (--json)
  env        versions, platform, devices, plugins and config file, ready to paste in a bug report
  config     write the config file: questions, or `config default`; also `config update`, `config show`
  test       run a short real check of the installation with the current config (accel test -n 2)
  new-plugin write a new plugin project (tracker or strategy) from a template, with its tests
  estimate-memory  per-process training memory of a model under each installed strategy (--json)

options:
  -h, --help     show this message
  --version      print accel's version
"""


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
    if command == "launch":
        from accel.commands.launch import launch

        return run_guarded(lambda: launch(rest))
    if command == "plugins":
        from accel.commands.info import plugins_command

        return run_guarded(lambda: plugins_command(rest))
    if command == "env":
        from accel.commands.info import env_command

        return run_guarded(lambda: env_command(rest))
    if command == "config":
        from accel.commands.config import config_command

        return run_guarded(lambda: config_command(rest))
    if command == "test":
        from accel.commands.test_cmd import test_command

        return run_guarded(lambda: test_command(rest))
    if command == "new-plugin":
        from accel.commands.new_plugin import new_plugin_command

        return run_guarded(lambda: new_plugin_command(rest))
    if command == "estimate-memory":
        from accel.commands.estimate_memory import estimate_memory_command

        return run_guarded(lambda: estimate_memory_command(rest))
    from accel.options import did_you_mean

    commands = ["launch", "plugins", "env", "config", "test", "new-plugin", "estimate-memory"]
    return run_guarded(lambda: _unknown(command, did_you_mean(command, commands)))


def _unknown(command: str, hint: str) -> int:
    raise UsageError(f"unknown command {command!r}{hint} (see `accel --help`)")


if __name__ == "__main__":
    sys.exit(main())
