"""``accel launch`` for XLA: the exact commands, built without torch or torch_xla.

- On this machine: ``python -m accel_xla.spawn [options] script args``, which calls ``torch_xla.launch`` (PJRT: one
  process per local device; PJRT's CPU runtime always starts one).
- On a TPU pod (``tpu_use_cluster``): ``gcloud [alpha] compute tpus tpu-vm ssh NAME [--zone ZONE] --worker all
  --command "cd DIR && STARTUP && [sudo] env VARS python3 -m accel_xla.spawn ... script args"``: every worker runs
  the same spawn command in the same directory (the code must be there, as with Accelerate's pod launcher); the
  run's settings travel in ``ACCEL_CONFIG`` (base64, so no quoting survives two shells), ``PJRT_DEVICE=TPU`` and
  the ``tpu_env`` variables are set for it.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from accel.spi import LaunchPlan, Settings, UsageError, run_process, unhonoured_launch_settings

#: Settings that only concern reaching the pod from here; they are not handed to the workers.
CLUSTER_KEYS = (
    "tpu_use_cluster",
    "tpu_name",
    "tpu_zone",
    "tpu_use_sudo",
    "tpu_env",
    "tpu_vm",
    "commands",
    "command_file",
    "tpu_use_alpha",
)
#: Variables of ``accel launch`` the workers need besides ACCEL_CONFIG.
FORWARDED = ("ACCEL_DISABLE_PLUGINS", "ACCEL_PLUGINS")
REMOTE_PYTHON = "python3"
#: Launch settings torch_xla.launch (and the pod's gcloud ssh) do not carry out: a run that sets one is refused in
#: one line, never silently ignored (PJRT decides the processes and their devices; a pod's workers are reached
#: through gcloud, not a rendezvous).
NOT_HONOURED = (
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "rdzv_backend",
    "rdzv_conf",
    "gpu_ids",
    "max_restarts",
    "tee",
    "log_dir",
    "role",
    "enable_cpu_affinity",
    "num_cpu_threads_per_process",
)


@dataclass
class XLALaunch:
    """What ``accel_launch`` will run, decided (and checked) when the component is activated."""

    pod: bool
    spawn_args: list[str] = field(default_factory=list)  # options of accel_xla.spawn before the script
    tpu_name: str = ""
    tpu_zone: str = ""
    sudo: bool = False
    alpha: bool = False
    env: list[tuple[str, str]] = field(default_factory=list)
    startup: list[str] = field(default_factory=list)
    notice: str = ""


def plan(settings: Settings) -> XLALaunch:
    """Check the launch options and decide the launch; raise UsageError (one line) before anything starts."""
    refused = unhonoured_launch_settings(settings, NOT_HONOURED)
    if settings.get("main_process_port"):  # PJRT picks its own ports
        refused.append(f"main_process_port={settings['main_process_port']!r}")
    if refused:
        raise UsageError(
            f"the xla plugin does not carry out {', '.join(refused)} (torch_xla.launch starts one "
            f"process per local XLA device; a TPU pod is reached with --tpu_cluster): drop "
            f"{'it' if len(refused) == 1 else 'them'}"
        )
    spawn_args: list[str] = []
    notice = ""
    if settings.sources.get("num_processes", "default") != "default":
        if settings["num_processes"] == 1:
            spawn_args.append("--single_process")
        else:  # torch_xla.launch takes 1 or "all"
            notice = (
                f"num_processes={settings['num_processes']} is not passed on: torch_xla.launch starts one "
                "process per local XLA device (PJRT decides; its CPU runtime starts one)"
            )
    if settings.sources.get("main_training_function", "default") != "default":
        spawn_args += ["--main_training_function", str(settings["main_training_function"])]
    if not settings["tpu_use_cluster"]:
        given = [k for k in CLUSTER_KEYS[1:] if settings.sources.get(k, "default") in ("flag", "argument")]
        if given:
            raise UsageError(f"--{given[0]} only applies to a TPU pod launch; add --tpu_cluster (tpu_use_cluster)")
        return XLALaunch(pod=False, spawn_args=spawn_args, notice=notice)
    if not settings["tpu_name"]:
        raise UsageError("a TPU pod launch (tpu_use_cluster) needs --tpu_name (the TPU's name in gcloud)")
    if settings["tpu_vm"]:
        raise UsageError(
            "tpu_vm (legacy TPU-node VM names) is not supported: accel reaches every worker of a TPU "
            "VM pod with `gcloud compute tpus tpu-vm ssh NAME --worker all`; remove tpu_vm"
        )
    env = []
    for entry in settings["tpu_env"]:
        name, sep, value = str(entry).partition("=")
        if not sep or not name.isidentifier():
            raise UsageError(f"tpu_env entries are NAME=VALUE, got {entry!r}")
        env.append((name, value))
    startup = [str(c) for c in settings["commands"]]
    if settings["command_file"]:
        path = settings["command_file"]
        try:
            with open(path, encoding="utf-8") as fh:
                startup += [line.rstrip("\n") for line in fh if line.strip() and not line.lstrip().startswith("#")]
        except OSError as exc:
            raise UsageError(f"command_file {path!r} cannot be read: {exc.strerror}") from None
    return XLALaunch(
        pod=True,
        spawn_args=spawn_args,
        tpu_name=str(settings["tpu_name"]),
        tpu_zone=str(settings["tpu_zone"] or ""),
        sudo=bool(settings["tpu_use_sudo"]),
        alpha=bool(settings["tpu_use_alpha"]),
        env=env,
        startup=startup,
        notice=notice,
    )


def local_command(spec: XLALaunch, launch: LaunchPlan) -> list[str]:
    if not launch.python:
        raise UsageError("--no_python cannot be used with the xla plugin: torch_xla.launch starts Python processes")
    return [launch.python, "-m", "accel_xla.spawn", *spec.spawn_args, *launch.command]


def worker_config(env: Mapping[str, str]) -> str:
    """ACCEL_CONFIG for the pod's workers: the run's settings without the pod-reaching ones, base64-encoded."""
    handed = json.loads(env.get("ACCEL_CONFIG") or "{}")
    for key in CLUSTER_KEYS:
        handed.pop(key, None)
    return "base64:" + base64.b64encode(json.dumps(handed, sort_keys=True).encode()).decode()


def pod_command(spec: XLALaunch, launch: LaunchPlan, cwd: str) -> list[str]:
    """The exact gcloud command that starts the run on every worker of the pod."""
    if not launch.python:
        raise UsageError("--no_python cannot be used with the xla plugin: torch_xla.launch starts Python processes")
    variables = [("PJRT_DEVICE", "TPU"), ("ACCEL_CONFIG", worker_config(launch.env))]
    variables += [(k, launch.env[k]) for k in FORWARDED if launch.env.get(k)]
    variables += spec.env
    worker = (["sudo"] if spec.sudo else []) + ["env", *(f"{k}={v}" for k, v in variables)]
    worker += [REMOTE_PYTHON, "-m", "accel_xla.spawn", *spec.spawn_args, *launch.command]
    remote = " && ".join([f"cd {shlex.quote(cwd)}", *spec.startup, shlex.join(worker)])
    cmd = ["gcloud", *(["alpha"] if spec.alpha else []), "compute", "tpus", "tpu-vm", "ssh", spec.tpu_name]
    if spec.tpu_zone:
        cmd += ["--zone", spec.tpu_zone]
    return cmd + ["--worker", "all", "--command", remote]


def run(spec: XLALaunch, launch: LaunchPlan) -> int:
    """Answer ``accel_launch``: print the command (dry run) or run it and return its exit code."""
    if spec.notice:
        print(f"accel: note: {spec.notice}", file=sys.stderr)
    if spec.pod:
        cmd = pod_command(spec, launch, os.getcwd())
        if launch.dry_run:
            print(f"launcher: xla (TPU pod {spec.tpu_name}, every worker through gcloud): {shlex.join(cmd)}")
            return 0
        if shutil.which("gcloud") is None:
            raise UsageError(
                "a TPU pod launch runs `gcloud compute tpus tpu-vm ssh`, and gcloud is not installed "
                "here (https://cloud.google.com/sdk/docs/install)"
            )
        return run_process(cmd, os.environ, "gcloud and the pod's processes")
    cmd = local_command(spec, launch)
    if launch.dry_run:
        print(f"launcher: xla (torch_xla.launch, one process per local XLA device): {shlex.join(cmd)}")
        return 0
    return run_process(cmd, launch.env, "the XLA processes")  # die with accel launch; signals end it in one line
