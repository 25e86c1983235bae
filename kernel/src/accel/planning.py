"""The launch plan: what ``accel launch``, ``notebook_launcher`` and ``debug_launcher`` check before starting
anything, in one place (library code; the CLI builds on it, never the reverse).

A plan is made in two steps so the command line can check its own input (the script exists) in between:

- :func:`resolve_plan`: every option's value from its sources (flags > values handed over > environment > config
  file > defaults), the hardware's answer where ``--multi_gpu`` leaves the process count open, and the checks that
  need several values at once (:func:`check`);
- :func:`activate_plan`: the installed plugins asked to take part in a run of that many processes (roles,
  capabilities: a missing strategy is one line here, not a failure in every process), and a flag of a plugin that
  does not take part refused.

Each raises ``UsageError`` with one line. No torch import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from accel.errors import UsageError
from accel.options import KERNEL, Options, Settings, resolve
from accel.plugins import Plugins

#: torchrun's --tee: one stream choice for every process, or per local rank ("0:3,1:2").
TEE = re.compile(r"[0-3]|\d+:[0-3](,\d+:[0-3])*")


def resolve_plan(
    plugins: Plugins,
    env: Mapping[str, str],
    *,
    flags: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
    launched: Mapping[str, Any] | None = None,
    notices: list[str] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """(values, sources) of every option for a launch, checked. Notices (one line each) are appended to
    ``notices``."""
    values, sources = resolve(plugins.options(), flags=flags, config=config, launched=launched, env=env)
    if values["multi_gpu"] and sources["num_processes"] == "default":
        values["num_processes"] = max(1, plugins.detect_hardware(env).device_count)
        sources["num_processes"] = "hardware"
    check(values)
    if values["enable_cpu_affinity"] and plugins.detect_hardware(env).name == "cpu":
        values["enable_cpu_affinity"] = False
        if notices is not None:
            notices.append(
                "--enable_cpu_affinity binds each process to the CPUs next to its GPU; there is no GPU here, "
                "so it does nothing"
            )
    return values, sources


def activate_plan(
    plugins: Plugins, values: dict[str, Any], sources: dict[str, str], env: Mapping[str, str]
) -> Settings:
    """The settings of the launch, once the plugins taking part in it are activated (``plugins.components``)."""
    settings = Settings(values, sources, world_size=values["num_processes"], phase="launch", env=env)
    plugins.activate(settings)
    refuse_idle_plugin_flags(plugins.options(), values, sources, {c.name for c in plugins.components})
    return settings


def check(values: Mapping[str, Any]) -> None:
    """Checks that need several values at once (single values were checked by their Option)."""
    if values.get("cpu") and values.get("gpu_ids") and str(values["gpu_ids"]).lower() != "all":
        raise UsageError(
            f"--cpu and --gpu_ids {values['gpu_ids']} contradict each other: --cpu trains on the CPU; drop one of them"
        )
    tee = values.get("tee")
    if tee is not None and not TEE.fullmatch(str(tee)):
        raise UsageError(
            f"--tee expects 0 (none), 1 (stdout), 2 (stderr), 3 (both) or per local rank such as '0:3,1:2', got {tee!r}"
        )

    if values["machine_rank"] >= values["num_machines"]:
        raise UsageError(
            f"--machine_rank {values['machine_rank']} is out of range for --num_machines "
            f"{values['num_machines']} (ranks go from 0 to {values['num_machines'] - 1})"
        )
    if values["num_processes"] % values["num_machines"]:
        raise UsageError(
            f"--num_processes {values['num_processes']} is not a multiple of --num_machines "
            f"{values['num_machines']} (num_processes counts the processes of all machines)"
        )
    if values["num_machines"] > 1 and not values["main_process_ip"]:
        raise UsageError("a run on several machines needs --main_process_ip (the address of the machine of rank 0)")
    if values["compute_environment"] != "LOCAL_MACHINE":
        raise UsageError(f"compute_environment {values['compute_environment']} is not supported; use LOCAL_MACHINE")


def refuse_idle_plugin_flags(
    options: Options, values: Mapping[str, Any], sources: Mapping[str, str], active: set[str]
) -> None:
    """A flag of an installed plugin that does not take part in this run would silently change nothing: refuse it
    (one that sets the default value, such as ``--no_tpu_cluster``, asks for nothing and passes)."""
    for opt in options:
        if (
            opt.plugin != KERNEL
            and sources.get(opt.name) == "flag"
            and opt.plugin not in active
            and values.get(opt.name) != opt.default
        ):
            raise UsageError(
                f"--{opt.name} is an option of plugin {opt.plugin!r}, which does not take part in this "
                f"run; select it (--plugin {opt.plugin}) or drop the flag"
            )
