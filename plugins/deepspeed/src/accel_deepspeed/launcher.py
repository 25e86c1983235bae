"""Launch commands for DeepSpeed runs (no torch import; pure functions so tests can check them exactly).

- One machine, or ``deepspeed_multinode_launcher: standard``: torchrun (``torch.distributed.run``), started on every
  machine, exactly like the DDP plugin.
- Several machines with ``pdsh``, ``openmpi``, ``mvapich``, ``mpich`` or ``slurm``: DeepSpeed's own runner
  (``python -m deepspeed.launcher.runner``), started once, which reaches the other machines through that tool;
  with ``nossh`` the runner is started on every machine (``--no_ssh --node_rank``) and starts its local processes.
  The runner only forwards some environment variables to remote processes; accel's own (``ACCEL_*``) and the
  rendezvous address travel in a DeepSpeed environment file (``DS_ENV_FILE``) that the runner turns into
  ``export``/``-x``/``--export`` arguments. ``ACCEL_CONFIG`` travels base64-encoded, because those launchers re-quote
  values and JSON would not survive that.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from accel.spi import Settings, UsageError

#: Launchers that need no --include/--exclude/--num_nodes/--num_gpus (DeepSpeed refuses them there).
MPI_LAUNCHERS = ("openmpi", "mvapich", "mpich")
#: Variables of the launching environment that the workers need and DeepSpeed's runner would not forward.
FORWARDED = ("OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES")


def read_hostfile(path: str) -> dict[str, int]:
    """``host slots=N`` lines of an MPI-style hostfile (comments and blank lines skipped), as {host: slots}."""
    hosts: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        raise UsageError(f"DeepSpeed hostfile {path!r} does not exist (--deepspeed_hostfile)") from None
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if not match:
            raise UsageError(f"{path}:{number}: expected 'HOST slots=N', got {line!r}")
        if match.group(1) in hosts:
            raise UsageError(f"{path}:{number}: host {match.group(1)!r} is listed twice")
        hosts[match.group(1)] = int(match.group(2))
    if not hosts:
        raise UsageError(f"DeepSpeed hostfile {path} lists no hosts")
    return hosts


@dataclass
class RunnerPlan:
    """What ``accel launch`` runs for DeepSpeed's multi-machine runner."""

    argv: list[str]  # the runner command, from the interpreter on
    exports: dict[str, str]  # variables for every worker, written to the DS_ENV_FILE
    env: dict[str, str] = field(default_factory=dict)  # environment of the runner process itself

    def env_file_text(self) -> str:
        return "".join(f"{key}={value}\n" for key, value in self.exports.items())


def uses_runner(settings: Settings) -> bool:
    return settings["num_machines"] > 1 and settings["deepspeed_multinode_launcher"] != "standard"


def check_filters(settings: Settings) -> None:
    include, exclude = settings.get("deepspeed_inclusion_filter"), settings.get("deepspeed_exclusion_filter")
    if (include or exclude) and not uses_runner(settings):
        raise UsageError(
            "--deepspeed_inclusion_filter/--deepspeed_exclusion_filter select hosts and slots of "
            "DeepSpeed's runner: they need --num_machines > 1 and a --deepspeed_multinode_launcher other "
            "than standard"
        )
    if include and exclude:
        raise UsageError("give either --deepspeed_inclusion_filter or --deepspeed_exclusion_filter, not both")


def runner_plan(
    settings: Settings, command: list[str], python: str, env: Mapping[str, str], no_python: bool = False
) -> RunnerPlan:
    """The exact DeepSpeed runner command and the variables every worker gets, for a multi-machine launch."""
    launcher = settings["deepspeed_multinode_launcher"]
    check_filters(settings)
    hostfile = settings.get("deepspeed_hostfile")
    if not hostfile:
        raise UsageError(
            f"--deepspeed_multinode_launcher {launcher} needs --deepspeed_hostfile (lines "
            "'HOST slots=N', one per machine)"
        )
    hosts = read_hostfile(hostfile)
    machines, total = settings["num_machines"], settings["num_processes"]
    if total % machines:
        raise UsageError(f"--num_processes {total} is not a multiple of --num_machines {machines}")
    per_machine = total // machines
    include, exclude = settings.get("deepspeed_inclusion_filter"), settings.get("deepspeed_exclusion_filter")
    if launcher in MPI_LAUNCHERS:
        if include or exclude:
            raise UsageError(
                f"DeepSpeed's {launcher} launcher runs one process per slot of every host of the "
                "hostfile: it takes no inclusion/exclusion filter; edit the hostfile instead"
            )
        if len(hosts) != machines or sum(hosts.values()) != total:
            raise UsageError(
                f"the {launcher} launcher starts one process per slot of {hostfile} ({len(hosts)} "
                f"hosts, {sum(hosts.values())} slots), but the run asks for {machines} machines and "
                f"{total} processes; make them agree"
            )
    elif not (include or exclude):
        if len(hosts) < machines or any(slots < per_machine for slots in list(hosts.values())[:machines]):
            raise UsageError(
                f"{hostfile} does not offer {machines} hosts with {per_machine} slots each (it lists {hosts})"
            )
    ip = settings["main_process_ip"]
    port = settings["main_process_port"] or 29500
    how = (
        ["--no_ssh", "--node_rank", str(settings["machine_rank"])] if launcher == "nossh" else ["--launcher", launcher]
    )
    argv = [
        python,
        "-u",
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        hostfile,
        *how,
        "--master_addr",
        str(ip),
        "--master_port",
        str(port),
        "--no_local_rank",
    ]
    if include:
        argv += ["--include", include]
    elif exclude:
        argv += ["--exclude", exclude]
    elif launcher not in MPI_LAUNCHERS:
        argv += ["--num_nodes", str(machines), "--num_gpus", str(per_machine)]
    if no_python:
        argv.append("--no_python")
    elif command[:1] == ["-m"]:
        argv.append("--module")
        command = command[1:]
    argv += ["--", *command]  # the runner would take a script option (--num) for an abbreviation of its own
    exports: dict[str, str] = {}
    for key in sorted(env):
        if key.startswith("ACCEL_") or key in FORWARDED:
            value = env[key]
            if key == "ACCEL_CONFIG":
                value = "base64:" + base64.b64encode(value.encode()).decode()
            exports[key] = value
    exports["MASTER_ADDR"] = str(ip)
    exports["MASTER_PORT"] = str(port)
    return RunnerPlan(argv=argv, exports=exports, env=dict(env))
