"""Benchmark: ``save_state`` + ``load_state`` of a ~500 MB model against raw safetensors on the same disk.

    python bench/checkpoint.py [--size-mb 512] [--repeats 11] [--dir DIR] [--write]
    python bench/checkpoint.py --async-save [--size-mb 512] [--repeats 7] [--json] [--write]

The raw baseline is what the same tensors cost by hand: ``safetensors.torch.save_file(model.state_dict())`` then
``load_file`` + ``model.load_state_dict`` (loading means the weights end up in the model; ``load_file`` alone maps
the file lazily). It is measured twice: as is, and with an ``os.fsync`` of the file after writing, because
``save_state`` fsyncs every file and directory before it publishes a checkpoint (that is what makes a crash leave a
complete checkpoint). ``ratio`` = raw time / save_state+load_state time (1.0 = no overhead; higher is better).
Each round runs every variant once (alternating the order); the ratio is the median over rounds of the per-round
ratio, so rounds disturbed by other work on a shared machine cancel out. The page cache stays warm.

``--async-save``: how long ``save_state(asynchronous=True)`` blocks the training loop (the copy to CPU memory),
against the synchronous ``save_state`` (write, fsync, publish) and raw ``safetensors.torch.save_file`` of the same
tensors, for a model with Adam state (``--size-mb`` of parameters, three times that in the checkpoint). The first
asynchronous save allocates the CPU copies (reported apart); later ones refill them. ``--json`` prints the result as
one JSON line (what ``bench/run.py`` reads); ``--write`` updates the ``checkpoint-async`` section.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel import Kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, write_section  # noqa: E402


def build(size_mb: float, width: int = 2048) -> nn.Module:
    per_layer = (width * width + width) * 4
    layers = max(1, round(size_mb * 2**20 / per_layer))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_round(model: nn.Module, path: Path, fsync: bool) -> tuple[float, float]:
    from safetensors.torch import load_file, save_file

    def save() -> None:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.fspath(path))
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    def load() -> None:
        model.load_state_dict(load_file(os.fspath(path)))

    t_save, t_load = timed(save), timed(load)
    path.unlink()
    return t_save, t_load


PARTS: dict[str, list[float]] = {
    "save: safetensors write": [],
    "save: fsync": [],
    "save: everything else": [],
    "load: safetensors read + copy into the model": [],
    "load: everything else": [],
}


@contextlib.contextmanager
def instrumented() -> Iterator[dict[str, float]]:
    """Time the tensor I/O inside save_state/load_state (safetensors, fsync, load_state_dict) to isolate the
    rest (manifest, JSON, checks, renames, collectives)."""
    import safetensors.torch as st

    import accel.checkpoint as ck

    spent = {"write": 0.0, "fsync": 0.0, "read": 0.0}
    originals = (st.save_file, ck.fsync_all, st.load_file, nn.Module.load_state_dict)
    # every module of the package that calls fsync_all (each imported the function by name)
    users = [
        m
        for name, m in sorted(sys.modules.items())
        if name.startswith("accel.checkpoint") and getattr(m, "fsync_all", None) is originals[1]
    ]

    def wrap(fn, key):  # type: ignore[no-untyped-def]
        def inner(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        return inner

    st.save_file, timed_fsync = wrap(originals[0], "write"), wrap(originals[1], "fsync")
    for module in users:
        module.fsync_all = timed_fsync
    st.load_file, nn.Module.load_state_dict = wrap(originals[2], "read"), wrap(originals[3], "read")  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        st.save_file, _, st.load_file, nn.Module.load_state_dict = originals  # type: ignore[method-assign]
        for module in users:
            module.fsync_all = originals[1]


def accel_round(kernel: Kernel, target: Path) -> tuple[float, float]:
    with instrumented() as spent:
        t_save = timed(lambda: kernel.save_state(target))
        write, fsync = spent["write"], spent["fsync"]
        t_load = timed(lambda: kernel.load_state(target))
    shutil.rmtree(target)
    PARTS["save: safetensors write"].append(write)
    PARTS["save: fsync"].append(fsync)
    PARTS["save: everything else"].append(t_save - write - fsync)
    PARTS["load: safetensors read + copy into the model"].append(spent["read"])
    PARTS["load: everything else"].append(t_load - spent["read"])
    return t_save, t_load


def async_measure(size_mb: float, repeats: int, base: Path, width: int = 2048) -> dict[str, Any]:
    """Per round (variants in alternating order): the synchronous save's time, the asynchronous save's blocking
    time and its time until published, raw ``save_file`` of the same tensors with and without fsync."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    kernel = Kernel(cpu=True)
    model = build(size_mb, width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = kernel.prepare(model, optimizer)
    kernel.backward(model(torch.ones(1, width)).sum())  # one step: Adam gets its two state tensors per parameter
    optimizer.step()
    optimizer.zero_grad()
    params = sum(t.numel() * t.element_size() for t in model.state_dict().values())

    def raw_tensors() -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v for k, v in model.state_dict().items()}
        for i, state in optimizer.state_dict()["state"].items():
            out.update({f"optimizer.{i}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim()})
        return out

    def raw(fsync: bool) -> float:
        path = base / "raw.safetensors"
        start = time.perf_counter()
        save_file(raw_tensors(), os.fspath(path))
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        elapsed = time.perf_counter() - start
        path.unlink()
        return elapsed

    def sync() -> float:
        elapsed = timed(lambda: kernel.save_state(base / "sync"))
        shutil.rmtree(base / "sync")
        return elapsed

    batch = torch.randn(8, width)

    def train_step() -> float:
        start = time.perf_counter()
        kernel.backward(model(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    settings = kernel.settings

    def asynchronous(overlap: bool = False) -> tuple[float, float, float, float]:
        """save_state's time, the time until published, the next training step's time, and how long that step's
        optimizer.step waited for the copies left to the background thread (``overlap``: the async_save_overlap
        option, set for this save only)."""
        from accel.checkpoint import _SAVERS

        kernel.settings = dataclasses.replace(settings, values={**settings.values, "async_save_overlap": overlap})
        start = time.perf_counter()
        kernel.save_state(base / "async", asynchronous=True)
        blocked = time.perf_counter() - start
        job = _SAVERS[kernel].job
        step = train_step()  # the copy of parameters and Adam state overlaps this step's forward and backward
        waited = getattr(job, "step_waited", 0.0) if job is not None else 0.0
        kernel.wait_for_save()
        published = time.perf_counter() - start
        shutil.rmtree(base / "async")
        kernel.settings = settings
        return blocked, published, step, waited

    first = asynchronous()  # allocates the CPU copies that later saves refill
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in raw_tensors().values())
    rounds: dict[str, list[Any]] = {"sync": [], "async": [], "overlap": [], "raw": [], "raw+fsync": [], "step": []}
    variants: dict[str, Callable[[], Any]] = {
        "sync": sync,
        "async": asynchronous,
        "overlap": lambda: asynchronous(overlap=True),
        "raw": lambda: raw(False),
        "raw+fsync": lambda: raw(True),
        "step": train_step,  # a training step with no save in flight
    }
    for i in range(repeats):
        for name in list(variants) if i % 2 == 0 else list(reversed(variants)):
            rounds[name].append(variants[name]())
    kernel.end_training()
    return {
        "layers": len(model),
        "width": width,
        "param_bytes": params,
        "checkpoint_bytes": checkpoint_bytes,
        "first_async": first,
        "rounds": rounds,
        "repeats": repeats,
        "dir": os.fspath(base),
        "load_end": os.getloadavg()[0],
    }


def async_ratios(result: dict[str, Any], mode: str) -> list[float]:
    """Per round: what ``mode`` ("async": the copy before save_state returns; "overlap": async_save_overlap)
    blocked the training loop (save_state's own time plus what the next optimizer step waited) / the synchronous
    save."""
    r = result["rounds"]
    return [(a[0] + a[3]) / s for a, s in zip(r.get(mode, []), r["sync"], strict=False)]


def async_report(result: dict[str, Any]) -> tuple[str, float]:
    """The section's text, and the median per-round ratio blocked / synchronous save of the overlap mode."""
    r = result["rounds"]
    sync = r["sync"]

    def cells(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f}"

    rows = [
        "| variant | median (s) | best (s) | worst (s) |",
        "|---|---|---|---|",
        f"| synchronous `save_state` (write, fsync, publish) | {cells(sync)} |",
    ]
    for mode, title in (("async", "default: the copy made before it returns"), ("overlap", "`async_save_overlap`")):
        if not r.get(mode):
            continue
        runs = r[mode]
        rows += [
            f"| `save_state(asynchronous=True)`, {title}: training loop blocked (the two rows below) "
            f"| {cells([a[0] + a[3] for a in runs])} |",
            f"| ... in `save_state` | {cells([a[0] for a in runs])} |",
            f"| ... in the next `optimizer.step()`, waiting for the copy of parameters and optimizer state "
            f"| {cells([a[3] for a in runs])} |",
            f"| the next training step (forward, backward, step) minus one without a save in flight "
            f"| {cells([a[2] - s for a, s in zip(runs, r['step'], strict=True)])} |",
            f"| call until published (`wait_for_save`) | {cells([a[1] for a in runs])} |",
        ]
    rows += [
        f"| raw `safetensors.torch.save_file` of the same tensors | {cells(r['raw'])} |",
        f"| raw `save_file` + `os.fsync` | {cells(r['raw+fsync'])} |",
    ]
    info = (
        f"Model: {result['layers']} x Linear({result.get('width', 2048)}, {result.get('width', 2048)}), "
        f"{result['param_bytes'] / 2**20:.0f} MiB of fp32 parameters, Adam after one step: "
        f"{result['checkpoint_bytes'] / 2**20:.0f} MiB of tensors per checkpoint. {result['repeats']} rounds, "
        f"variants in alternating order; files on the disk of {result['dir']}; load average at the end "
        f"{result['load_end']:.1f}."
    )
    summary = []
    for mode, title in (("async", "default"), ("overlap", "async_save_overlap")):
        ratios = async_ratios(result, mode)
        if ratios:
            summary.append(
                f"{title}: median **{statistics.median(ratios):.1%}** (best {min(ratios):.1%}, worst {max(ratios):.1%})"
            )
    overlap = async_ratios(result, "overlap") or async_ratios(result, "async")
    text = (
        f"{info}\n\n" + "\n".join(rows) + "\n\n"
        f"Blocked / synchronous save, per round: {'; '.join(summary)}; goal: at most 10 %. By default the whole copy "
        "to CPU memory is made before `save_state` returns, so the checkpoint holds the state at the call whatever "
        "the script does next; its floor is one memory copy of the checkpoint (about a sixth of a synchronous save "
        "here). With `async_save_overlap` the copy of parameters and optimizer state runs on the background thread "
        "during the next forward and backward, and the next `optimizer.step()` waits for it and checks, by the "
        "tensors' version counters, that nothing else changed them in place meanwhile (a change fails the save in "
        "one line; a write through `.data` cannot be seen, so the script must not make one before that step). The "
        "training step's own slowdown while the copy runs beside it (memory bandwidth and a core shared with the "
        "copy and the write) is the row under each. The first asynchronous save of a run also allocates the CPU "
        f"copies: it blocked {result['first_async'][0]:.2f} s (published after {result['first_async'][1]:.2f} s); "
        "later saves refill the same memory (a fresh allocation is touched page by page, several times slower "
        "than the copy). The price is one checkpoint's worth of CPU memory, held until `end_training`."
    )
    return text, statistics.median(overlap)


def async_main(args: argparse.Namespace) -> None:
    header = machine()
    base = Path(args.dir or tempfile.mkdtemp(prefix="accel-bench-async-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        if args.checkpoint_mib:  # the checkpoint's size: parameters and Adam's two states, Linear(1024, 1024)s
            result = async_measure(args.checkpoint_mib / 3, args.repeats, base, width=1024)
        else:
            result = async_measure(args.size_mb, args.repeats, base)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return
    text, _ = async_report(result)
    print(text)
    if args.write:
        write_section(
            "checkpoint-async",
            "## Asynchronous save: time the training loop is blocked\n\n"
            f"`python bench/checkpoint.py --async-save --write`; {header}\n\n{text}\n",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default: 11; 7 with --async-save)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--write", action="store_true", help="update the checkpoint section of docs/benchmarks.md")
    parser.add_argument("--async-save", action="store_true", help="asynchronous save vs synchronous vs raw")
    parser.add_argument("--json", action="store_true", help="with --async-save: print the result as JSON")
    parser.add_argument(
        "--checkpoint-mib", type=float, default=None, help="with --async-save: the checkpoint's size (not --size-mb)"
    )
    args = parser.parse_args()
    if args.async_save:
        args.repeats = args.repeats or 7
        async_main(args)
        return
    args.repeats = args.repeats or 11
    header = machine()

    base = Path(args.dir or tempfile.mkdtemp(prefix="accel-bench-ckpt-"))
    base.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    kernel = Kernel(cpu=True)
    model = build(args.size_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no optimizer state: the checkpoint is the model
    model, optimizer = kernel.prepare(model, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())

    results: dict[str, list[tuple[float, float]]] = {"raw": [], "raw+fsync": [], "accel": []}
    rounds = {
        "raw": lambda: raw_round(model, base / "raw.safetensors", fsync=False),
        "raw+fsync": lambda: raw_round(model, base / "raw.safetensors", fsync=True),
        "accel": lambda: accel_round(kernel, base / "ckpt"),
    }
    try:
        for i in range(args.repeats):
            order = list(rounds) if i % 2 == 0 else list(reversed(rounds))  # no variant always goes first
            for name in order:
                results[name].append(rounds[name]())
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)

    def total(name: str, i: int) -> float:
        return results[name][i][0] + results[name][i][1]

    rows = [
        "| variant | save (s), median | load (s), median | save + load (s), median | save + load (s), best "
        "| ratio raw / accel (median of per-round ratios) |",
        "|---|---|---|---|---|---|",
    ]
    labels = (
        ("raw", "raw safetensors (`save_file`; `load_file` + `load_state_dict`)"),
        ("raw+fsync", "raw safetensors + `os.fsync` of the file"),
        ("accel", "`save_state` + `load_state`"),
    )
    for name, label in labels:
        saves = [r[0] for r in results[name]]
        loads = [r[1] for r in results[name]]
        totals = [total(name, i) for i in range(args.repeats)]
        ratios = [total(name, i) / total("accel", i) for i in range(args.repeats)]
        ratio = "" if name == "accel" else f"{statistics.median(ratios):.2f}x"
        rows.append(
            f"| {label} | {statistics.median(saves):.2f} | {statistics.median(loads):.2f} "
            f"| {statistics.median(totals):.2f} | {min(totals):.2f} | {ratio} |"
        )
    disk = shutil.disk_usage(base if base.exists() else base.parent)
    info = (
        f"Model: {len(model)} x Linear(2048, 2048), {nbytes / 2**20:.0f} MiB of fp32 tensors, SGD without state. "
        f"{args.repeats} rounds, each running every variant once; files on the disk of {base} "
        f"({disk.total / 2**30:.0f} GiB); warm page cache; load average at the end {os.getloadavg()[0]:.1f}."
    )
    rows += [
        "",
        "Where `save_state` / `load_state` spend their time (median over the rounds):",
        "",
        "| part | ms |",
        "|---|---|",
    ]
    rows += [f"| {part} | {statistics.median(values) * 1e3:.0f} |" for part, values in PARTS.items()]
    overhead = statistics.median(PARTS["save: everything else"]) + statistics.median(PARTS["load: everything else"])
    fsync = statistics.median(PARTS["save: fsync"])
    rows += [
        "",
        f"Reading: besides the tensor I/O that raw safetensors does too, `save_state` + `load_state` spend "
        f"{overhead * 1e3:.0f} ms (manifest, JSON, random states, checks, renames) and {fsync * 1e3:.0f} ms "
        "in fsync, which is what makes a crash leave a complete checkpoint; against raw safetensors that "
        "also fsyncs, the two do the same work. The timings on a shared machine vary from run to run "
        "(see the load average); the per-round ratio is the steadier figure.",
    ]
    table = "\n".join(rows)
    print(info)
    print(table)
    if args.write:
        write_section(
            "checkpoint",
            "## Checkpoints: `save_state` + `load_state` vs raw safetensors\n\n"
            f"`python bench/checkpoint.py --write`; {header}\n\n{info}\n\n{table}\n",
        )
    kernel.end_training()
    sys.exit(0)


if __name__ == "__main__":
    main()
