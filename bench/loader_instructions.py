"""Instructions per sample of a DataLoader pass with worker processes, the main process and its workers together,
raw vs prepared, counted by valgrind (callgrind): the work accel adds to loading with workers, free of the timing
noise that 2-4 worker processes on 2 shared cores give the wall-time rows (bench/dataloader.py).

    python bench/loader_instructions.py            # runs itself under valgrind; prints JSON

The worker (``--worker``) makes one pass of each loader (bench/dataloader.py's datasets; no worker process, and 2
worker processes started afresh, as ``persistent_workers=False`` does) between two calls of ``os.getppid()``; callgrind
(``--dump-before=os_getppid*``, one output file per process) dumps the main process's counts per pass. A worker
process is forked with its parent's counts so far, and torch's worker loop calls ``os.getppid()`` (its watchdog)
before it takes its first batch and between batches; so a worker's first dump (what it inherited, and its set-up
before the loop) is left out and the rest is its loading. The worker's set-up before its loop (torch's seeding,
``worker_init_fn``) is the same for both loaders and a per-process constant, not a per-batch cost.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import callgrind, callgrind_total, worker_or_measure

WORKERS = (0, 2)  # no worker process (the main process loads), and 2 (the cores of this machine)
SAMPLES = int(os.environ.get("BENCH_LOADER_SAMPLES", 4096))  # a pass: 64 batches of 64, 32 per worker


def loaders(samples: int) -> dict[str, Callable[[], Any]]:
    """name -> a function making the loader over ``samples`` samples (a new one for each pass)."""
    from dataloader import BATCH, MapData, StreamData
    from torch.utils.data import DataLoader

    from accel import Kernel

    kernels = {True: Kernel(cpu=True), False: Kernel(cpu=True, reseed_workers=False)}
    out: dict[str, Callable[[], Any]] = {}
    for workers in WORKERS:
        for kind, cls in (("map", MapData), ("iterable", StreamData)):
            for augment in (False, True):
                case = f"{kind}, {'augmented' if augment else 'plain'}, num_workers={workers}"

                def raw(cls: Any = cls, augment: bool = augment, workers: int = workers) -> Any:
                    return DataLoader(cls(augment, samples), batch_size=BATCH, num_workers=workers)

                out[f"{case}|raw"] = raw
                out[f"{case}|accel"] = lambda raw=raw: kernels[True].prepare(raw())
                if kind == "map" and workers:  # reseeding is per batch in a worker; an iterable loader is not reseeded
                    out[f"{case}|accel, reseed_workers=False"] = lambda raw=raw: kernels[False].prepare(raw())
    return out


def worker() -> None:
    import torch

    torch.set_num_threads(1)
    for make in loaders(4 * 64).values():  # warm-up: a short pass of each (imports, first-call caches)
        for _ in make():
            pass
    made = loaders(SAMPLES)
    pids: dict[str, list[int]] = {}
    samples: dict[str, int] = {}
    for name, make in made.items():
        loader = make()
        os.getppid()  # callgrind dumps the main process's counts so far: each pass lies between two of these
        seen, children = 0, set()
        for x, _ in loader:
            seen += len(x)
            children |= {p.pid for p in multiprocessing.active_children()}
        os.getppid()
        pids[name], samples[name] = sorted(children), seen
    print(json.dumps({"main": os.getpid(), "names": list(made), "pids": pids, "samples": samples}))


def measure() -> dict[str, Any]:
    if shutil.which("valgrind") is None:
        return {"skipped": "valgrind is not installed"}
    with tempfile.TemporaryDirectory() as tmp:
        stdout = callgrind(__file__, f"{tmp}/cg.%p", env={**os.environ, "PYTHONHASHSEED": "0"})
        got = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
        dumps: dict[int, dict[int, int]] = {}  # pid -> dump number -> instructions (the dump at exit: the last)
        for path in Path(tmp).glob("cg.*"):
            parts = path.name.split(".")
            pid = int(parts[1])
            number = int(parts[2].split("-")[0]) if len(parts) > 2 else 10**9
            dumps.setdefault(pid, {})[number] = callgrind_total(path) or 0
    main = dumps[got["main"]]
    # the main process: dump 1 ends at the first getppid (start-up, warm-up, making the first loader); pass k (from
    # 0) is dump 2k+2, which ends at the getppid after it; dump 2k+3 is making the next loader
    result: dict[str, dict[str, float]] = {}
    for k, name in enumerate(got["names"]):
        in_main = main[2 * k + 2]
        in_workers = sum(sum(n for d, n in dumps[pid].items() if d != min(dumps[pid])) for pid in got["pids"][name])
        n = got["samples"][name]
        result[name] = {
            "main": in_main / n,
            "workers": in_workers / n,
            "total": (in_main + in_workers) / n,
            "worker_processes": len(got["pids"][name]),
        }
    return {"samples": SAMPLES, "instructions_per_sample": result}


def main() -> None:
    worker_or_measure(worker, measure)


if __name__ == "__main__":
    main()
