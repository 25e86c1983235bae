"""The launch-settings check of the launcher and strategy conformance suites (:mod:`accel.testing.conformance`).

For every launch setting of :data:`accel.contract.LAUNCH_UNSET`, and ``main_process_port``, ``accel launch
--dry-run`` runs once with that setting asking for something (a distinctive value). The launcher that answers
``accel_launch`` must then either **honour** it, which a dry run shows: the value appears in what the launcher
printed (its command line) or in the environment it gives the workers (``ACCEL_CONFIG`` aside, which carries every
setting whoever launches); or **refuse** it: exit 2 with one line naming the setting, and nothing started.
A launcher that does neither runs something else than what was asked (``--num_machines 2`` as two separate
one-machine jobs, ``--max_restarts`` with no restart).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from accel.contract import LAUNCH_UNSET

IP = "10.11.12.13"


@dataclass(frozen=True)
class Probe:
    """One dry run: ``flags`` set ``settings`` (the first is the one probed; multi-machine settings need
    others with them); ``evidence`` holds, per setting, the pattern its value makes in a launcher's output."""

    settings: tuple[str, ...]
    flags: tuple[str, ...]
    evidence: Mapping[str, str] = field(default_factory=dict)
    num_processes: int = 2


def shown(names: str, value: str) -> str:
    """The pattern of ``value`` given as one of ``names`` (``max_restarts|nnodes``): ``--name=value``,
    ``name value``, ``NAME=value``..."""
    return rf"(?i)(?<![\w-])-*(?:{names})[=: ]+['\"]?{re.escape(value)}(?![\w.])"


def literal(value: str) -> str:
    """The pattern of a value distinctive enough to be recognised alone (an address, a path, a port)."""
    return rf"(?<![\w.]){re.escape(value)}(?![\w.])"


def probes(log_dir: Path, port: int) -> list[Probe]:
    """One probe per launch setting (``port``: a free port for ``main_process_port``)."""
    machines = ("--num_machines", "3", "--main_process_ip", IP)
    spread = {"num_machines": shown("num_machines|nnodes", "3"), "main_process_ip": literal(IP)}
    return [
        Probe(("num_machines", "main_process_ip"), machines, spread, num_processes=6),
        Probe(
            ("machine_rank", "num_machines", "main_process_ip"),
            (*machines, "--machine_rank", "2"),
            {"machine_rank": shown("machine_rank|node_rank", "2"), **spread},
            num_processes=6,
        ),
        Probe(("main_process_ip",), ("--main_process_ip", IP), {"main_process_ip": literal(IP)}),
        Probe(("main_process_port",), ("--main_process_port", str(port)), {"main_process_port": literal(str(port))}),
        Probe(("rdzv_backend",), ("--rdzv_backend", "c10d"), {"rdzv_backend": shown("rdzv_backend", "c10d")}),
        Probe(("rdzv_conf",), ("--rdzv_conf", "join_timeout=321"), {"rdzv_conf": literal("join_timeout=321")}),
        Probe(("gpu_ids",), ("--gpu_ids", "1"), {"gpu_ids": shown("gpu_ids|CUDA_VISIBLE_DEVICES", "1")}),
        Probe(("max_restarts",), ("--max_restarts", "37"), {"max_restarts": shown("max_restarts", "37")}),
        Probe(
            ("num_cpu_threads_per_process",),
            ("--num_cpu_threads_per_process", "3"),
            {"num_cpu_threads_per_process": shown("num_cpu_threads_per_process|OMP_NUM_THREADS", "3")},
        ),
        Probe(
            ("enable_cpu_affinity",),
            ("--enable_cpu_affinity",),
            {"enable_cpu_affinity": r"(?i)enable_cpu_affinity|numa.binding|cpu.affinity"},
        ),
        Probe(("tee",), ("--tee", "2"), {"tee": shown("tee", "2")}),
        Probe(("log_dir",), ("--log_dir", str(log_dir)), {"log_dir": literal(str(log_dir))}),
        Probe(("role",), ("--role", "kitrole"), {"role": shown("role", "kitrole")}),
    ]


def probed_settings() -> list[str]:
    """The settings the probes cover: every key of ``LAUNCH_UNSET``, and ``main_process_port``."""
    return [*LAUNCH_UNSET, "main_process_port"]


def launcher_output(stdout: str) -> str:
    """What the launcher itself contributed to a dry run's output: the lines it printed after the kernel's plan
    (the hook list) and the environment lines, without ``ACCEL_CONFIG``."""
    plan, _, env = stdout.partition("environment for the workers")
    lines = plan.splitlines()
    # the kernel's sections ("settings (...)" and, with --verbose, "hooks (...)") end at their last indented line
    heads = [i for i, line in enumerate(lines) if line.startswith(("settings (", "hooks ("))]
    start = heads[-1] + 1 if heads else 0
    while start < len(lines) and lines[start].startswith("  "):
        start += 1
    own = lines[start:]
    own += [line for line in env.splitlines()[1:] if not line.strip().startswith("ACCEL_CONFIG=")]
    return "\n".join(own)


def asked(stdout: str, setting: str) -> bool:
    """Whether the dry run's plan hands ``setting`` to the launcher with a value that asks for something
    (``accel launch`` itself turns ``enable_cpu_affinity`` off where there is no GPU)."""
    match = re.search(rf"^  {setting} = (.*) \(", stdout, re.M)
    return match is not None and match.group(1) not in {repr(v) for v in LAUNCH_UNSET.get(setting, (None,))}


Launch = Callable[[Sequence[str], int], subprocess.CompletedProcess[str]]


def check_probe(probe: Probe, launch: Launch) -> tuple[str | None, bool]:
    """Run one probe as a dry run: ``(problem or None, refused)``."""
    flags = " ".join(probe.flags)
    proc = launch(["--dry-run", *probe.flags], probe.num_processes)
    if proc.returncode == 2:
        lines = proc.stderr.strip().splitlines()
        if len(lines) != 1 or not any(s in lines[0] for s in probe.settings):
            return (
                f"{flags}: refused (exit 2), but not in one line naming {probe.settings[0]}: {proc.stderr.strip()!r}",
                True,
            )
        return None, True
    if proc.returncode != 0:
        return f"{flags}: `accel launch --dry-run` exited with {proc.returncode}: {proc.stderr.strip()[-500:]}", False
    own = launcher_output(proc.stdout)
    for setting in probe.settings:
        if asked(proc.stdout, setting) and not re.search(probe.evidence[setting], own):
            return (
                f"{setting} was neither honoured nor refused: `accel launch --dry-run {flags}` exited 0 and the "
                f"launcher's command and environment do not show it (looked for /{probe.evidence[setting]}/ in "
                f"{own.strip()[:300]!r}); carry it out and show it in the dry-run line, or refuse it with a "
                "one-line UsageError (exit 2), never drop it silently",
                False,
            )
    return None, False


def check_launch_settings(launch: Launch, log_dir: Path, port: int, started: Callable[[Probe], str | None]) -> None:
    """Every probe honoured or refused (dry runs, side by side); for the first refused one, ``started(probe)`` runs
    it for real and says what was started despite the refusal (None: nothing). Raises AssertionError listing every
    problem."""
    all_probes = probes(log_dir, port)
    covered = {p.settings[0] for p in all_probes}
    assert covered == set(probed_settings()), f"launch settings without a probe: {set(probed_settings()) - covered}"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: check_probe(p, launch), all_probes))
    problems = [problem for problem, _ in results if problem]
    refused = [probe for probe, (problem, was_refused) in zip(all_probes, results, strict=True) if was_refused]
    if refused and not problems:
        extra = started(refused[0])
        if extra:
            problems.append(f"{' '.join(refused[0].flags)}: refused in a dry run, yet a real launch {extra}")
    if problems:
        raise AssertionError("launch settings the launcher ignores:\n" + "\n".join(f"- {p}" for p in problems))
