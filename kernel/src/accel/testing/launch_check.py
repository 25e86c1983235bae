"""The launch-settings check of the launcher and strategy conformance suites (:mod:`accel.testing.conformance`).

For every launch setting of :data:`accel.contract.LAUNCH_UNSET`, and ``main_process_port``, ``accel launch
--dry-run`` runs once with that setting asking for something (a distinctive value). The launcher that answers
``accel_launch`` must then either **honour** it, which a dry run shows: the value appears in what the launcher
printed (its command line) or in the environment it gives the workers (``ACCEL_CONFIG`` aside, which carries every
setting whoever launches); or **refuse** it: exit 2 with one line naming the setting, and nothing started.
A launcher that does neither runs something else than what was asked (``--num_machines 2`` as two separate
one-machine jobs, ``--max_restarts`` with no restart).

A dry run shows what a launcher says it does; real launches of a small script (:data:`WORKER`) show what it does:
with ``-n 1`` and ``-n 3`` exactly that many workers, ranks 0 to N-1, each with the plan's environment
(``ACCEL_CONFIG``), with ``--max_restarts 1`` (unless refused) a worker that failed once started again, and the
settings of :data:`CARRIED_OUT` (unless refused) seen by the workers (:func:`check_real_launches`).
"""

from __future__ import annotations

import json
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
    names = [
        problem.split(" ", 1)[0] if " was neither honoured" in problem else probe.settings[0]
        for probe, (problem, _) in zip(all_probes, results, strict=True)
        if problem
    ]
    refused = [probe for probe, (problem, was_refused) in zip(all_probes, results, strict=True) if was_refused]
    if refused and not problems:
        extra = started(refused[0])
        if extra:
            problems.append(f"{' '.join(refused[0].flags)}: refused in a dry run, yet a real launch {extra}")
            names.append(refused[0].settings[0])
    if problems:
        raise AssertionError(
            f"launch settings the launcher ignores: {', '.join(names)}\n" + "\n".join(f"- {p}" for p in problems)
        )


#: The script of the real launches: each worker writes what it was started with to ``OUT/worker-PID.json``; with a
#: second argument, the first worker to start exits with 7 instead, once (a run that is restarted then succeeds).
WORKER = """import json, os, sys
out = sys.argv[1]
if len(sys.argv) > 2:
    try:
        os.close(os.open(os.path.join(out, "failed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        sys.exit(7)
    except FileExistsError:
        pass
print("kit worker", os.environ.get("RANK", "0"), flush=True)
names = ("RANK", "WORLD_SIZE", "ACCEL_CONFIG", "OMP_NUM_THREADS", "MASTER_PORT")
with open(os.path.join(out, f"worker-{os.getpid()}.json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in names}, f)
"""

#: ``(num_processes, flags, worker script arguments) -> finished process``: a real ``accel launch`` of
#: :data:`WORKER`.
RealLaunch = Callable[[int, Sequence[str], Sequence[str]], subprocess.CompletedProcess[str]]


def _workers(out: Path) -> list[dict[str, str | None]]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("worker-*.json"))]


def _failed(what: str, proc: subprocess.CompletedProcess[str]) -> str:
    return f"{what} exited with {proc.returncode}: {proc.stderr.strip()[-800:]!r}"


def check_process_count(launch: RealLaunch, root: Path, n: int) -> list[str]:
    """A real ``accel launch -n N`` starts exactly N workers, ranks 0..N-1, each given the plan's environment
    (``ACCEL_CONFIG``, with this ``num_processes``): the problems found."""
    out = root / f"n{n}"
    out.mkdir(parents=True)
    proc = launch(n, [], [str(out)])
    if proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and not _workers(out):
        return []  # this count refused in one line, nothing started (check_real_launches needs one count to run)
    if proc.returncode != 0:
        return [_failed(f"a real `accel launch -n {n}`", proc)]
    workers = _workers(out)
    if len(workers) != n:
        return [
            f"a real `accel launch -n {n}` started {len(workers)} worker process(es), not {n} (its dry run plans "
            f"{n}): start settings['num_processes'] workers, never a fixed count"
        ]
    problems = []
    ranks = sorted(int(w["RANK"] or 0) for w in workers)
    if ranks != list(range(n)):
        problems.append(f"a real `accel launch -n {n}` gave its workers RANK {ranks}, not 0 to {n - 1}")
    without = [w["RANK"] for w in workers if not w["ACCEL_CONFIG"]]
    if without:
        problems.append(
            f"a real `accel launch -n {n}` started workers (RANK {', '.join(map(str, without))}) without "
            "ACCEL_CONFIG: start each worker with plan.env, the environment the dry run shows (settings such as "
            "mixed_precision and dynamo_backend reach the workers only through it), adding to it, never replacing it"
        )
    else:
        counts = {json.loads(str(w["ACCEL_CONFIG"])).get("num_processes", n) for w in workers}
        if counts != {n}:
            problems.append(f"a real `accel launch -n {n}` gave its workers ACCEL_CONFIG with num_processes {counts}")
    return problems


def check_restarts(launch: RealLaunch, root: Path, n: int) -> list[str]:
    """With ``--max_restarts 1`` and ``n`` processes, a launcher that does not refuse it starts a worker that
    failed once again, and the run succeeds: the problems found."""
    out = root / "restart"
    out.mkdir(parents=True)
    proc = launch(n, ["--max_restarts", "1"], [str(out), "fail-once"])
    ran = (out / "failed").exists()
    if proc.returncode == 2 and not ran:
        return []  # refused (the dry-run check sees that it is refused in one line)
    if proc.returncode == 0 and ran and _workers(out):
        return []
    return [
        f"max_restarts was not carried out: a real `accel launch -n {n} --max_restarts 1` whose worker exited with 7 "
        f"once {'started no worker' if not ran else 'did not start it again'} and exited with {proc.returncode}; "
        "restart the workers up to max_restarts times (or refuse the setting in one line, exit 2), never only show "
        "it in the dry run"
    ]


def _settings_flags(name: str, port: int, out: Path) -> list[str]:
    values = {"num_cpu_threads_per_process": "3", "main_process_port": str(port), "log_dir": str(out / "logs")}
    return [f"--{name}", values[name]]


def _setting_problem(name: str, port: int, out: Path) -> str | None:
    """Whether the workers of a launch with setting ``name`` (see :func:`_settings_flags`) show its effect."""
    workers = _workers(out)
    if name == "log_dir":
        logs = out / "logs"
        text = "\n".join(f.read_text(errors="replace") for f in logs.rglob("*") if f.is_file()) if logs.is_dir() else ""
        missing = [w["RANK"] or "0" for w in workers if f"kit worker {w['RANK'] or '0'}" not in text]
        if not missing:
            return None
        return f"log_dir was not carried out: no file under --log_dir holds the output of the workers of RANK {missing}"
    variable, value = {
        "num_cpu_threads_per_process": ("OMP_NUM_THREADS", "3"),
        "main_process_port": ("MASTER_PORT", str(port)),
    }[name]
    got = sorted({str(w[variable]) for w in workers})
    if got == [value]:
        return None
    return f"{name} was not carried out: `--{name} {value}` gave the workers {variable}={', '.join(got)}, not {value}"


#: The settings whose effect the workers of a real launch show (besides num_processes and max_restarts).
CARRIED_OUT = ("num_cpu_threads_per_process", "main_process_port", "log_dir")


def check_settings(launch: RealLaunch, root: Path, n: int, port: int) -> list[str]:
    """One real launch with every setting of :data:`CARRIED_OUT` (then, if that is refused, one per setting): each
    one not refused must show in the workers (``OMP_NUM_THREADS``, ``MASTER_PORT``, their output under ``log_dir``)."""
    out = root / "settings"
    out.mkdir(parents=True)
    flags = [f for name in CARRIED_OUT for f in _settings_flags(name, port, out)]
    runs: list[tuple[tuple[str, ...], Path, subprocess.CompletedProcess[str]]] = [
        (CARRIED_OUT, out, launch(n, flags, [str(out)]))
    ]
    if runs[0][2].returncode == 2 and not _workers(out):
        runs = []
        for name in CARRIED_OUT:
            own = root / f"setting-{name}"
            own.mkdir()
            runs.append(((name,), own, launch(n, _settings_flags(name, port, own), [str(own)])))
    problems = []
    for names, where, proc in runs:
        if proc.returncode == 2 and not _workers(where):
            continue  # refused (the dry-run check sees that it is refused in one line)
        if proc.returncode != 0:
            problems.append(_failed(f"a real `accel launch -n {n}` with {' '.join(names)} set", proc))
            continue
        problems += [p for name in names if (p := _setting_problem(name, port, where))]
    return problems


def check_real_launches(launch: RealLaunch, root: Path, counts: Sequence[int], port: int) -> None:
    """Real launches (side by side): one per process count of ``counts`` (a count the launcher refuses in one line
    is let pass, as long as one count runs), one with ``--max_restarts 1`` and one with the settings of
    :data:`CARRIED_OUT` (``port``: a free port for ``main_process_port``), with the first count. Raises
    AssertionError naming every problem."""
    with ThreadPoolExecutor(len(counts) + 2) as pool:
        futures = [pool.submit(check_process_count, launch, root, n) for n in counts]
        futures.append(pool.submit(check_restarts, launch, root, counts[0]))
        futures.append(pool.submit(check_settings, launch, root, counts[0], port))
        found = [future.result() for future in futures]
    problems = [problem for each in found for problem in each]
    ran = [n for n in counts if _workers(root / f"n{n}")]
    if not problems and not ran:
        problems.append(
            f"every real launch (-n {', -n '.join(map(str, counts))}) was refused: nothing could be checked"
        )
    if problems:
        topics = dict.fromkeys(topic for p in problems for key, topic in TOPICS if key in p)
        raise AssertionError(
            f"a real launch does not carry out its plan ({', '.join(topics) or 'it failed'}):\n"
            + "\n".join(f"- {p}" for p in problems)
        )


#: What a real launch's problem is about, for the first line of the failure: ``(words in the problem, topic)``.
TOPICS = (
    ("worker process(es), not", "num_processes"),
    ("RANK [", "ranks"),
    ("ACCEL_CONFIG", "plan.env"),
    ("max_restarts", "max_restarts"),
    *((f"{name} was not carried out", name) for name in CARRIED_OUT),
)
