"""Big-model loading: accel's load_checkpoint_and_dispatch against Accelerate's on the same safetensors files.

Writes one fp32 checkpoint (default 45 blocks, 1.5 GB, 4 shards with an index: Hugging Face's layout), then loads it
in fresh processes, alternating accel and Accelerate (Accelerate runs in its own venv, ACCEL_BENCH_ACCELERATE_PYTHON,
default /work/venvs/acc/bin/python), in two set-ups: everything in CPU memory (device_map={"": "cpu"}), and a 300 MB
CPU budget with the rest offloaded to disk (device_map="auto"). Each run reports the load time, the first forward's
time, the peak RSS over the process's baseline after imports, and whether the output equals the reference.

    python bench/big_model_load.py [--layers 45] [--repeats 3] [--budget 300MB] [--no-docs]

Results go to docs/benchmarks.md (section big-model-load) unless --no-docs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, machine, med, run_json, write_section  # noqa: E402

PROBE = ROOT / "tests" / "scripts" / "big_model_probe.py"
ACCELERATE_PYTHON = os.environ.get("ACCEL_BENCH_ACCELERATE_PYTHON", "/work/venvs/acc/bin/python")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=45)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", default="300MB")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    if not Path(ACCELERATE_PYTHON).exists():
        sys.exit(f"bench: no Accelerate python at {ACCELERATE_PYTHON}: set ACCEL_BENCH_ACCELERATE_PYTHON")
    header = machine()
    base = Path(tempfile.mkdtemp(prefix="accel-bench-bigmodel-"))
    try:
        ckpt = base / "ckpt"
        written = run_json([sys.executable, str(PROBE), "write", str(ckpt), "--layers", str(args.layers)])
        setups = {"cpu": ["--map", "cpu"], "disk": ["--map", "auto", "--budget", args.budget]}
        pythons = {"accel": sys.executable, "Accelerate": ACCELERATE_PYTHON}
        results: dict[tuple[str, str], list[dict]] = {}
        for i in range(args.repeats):
            for setup, extra in setups.items():
                for api, python in pythons.items():
                    offload = base / f"offload-{api}-{setup}-{i}"
                    cmd = [
                        python,
                        str(PROBE),
                        "load",
                        str(ckpt),
                        "--layers",
                        str(args.layers),
                        "--offload",
                        str(offload),
                        "--api",
                        "accel" if api == "accel" else "accelerate",
                        *extra,
                    ]
                    result = run_json(cmd)
                    if not result["equal"]:
                        sys.exit(f"bench: {api} {setup}: output differs from the reference ({result})")
                    results.setdefault((setup, api), []).append(result)
                    shutil.rmtree(offload, ignore_errors=True)
                    print(
                        f"{setup:5} {api:10} load {result['load_seconds']:6.2f}s forward "
                        f"{result['forward_seconds']:6.2f}s peak +{(result['peak'] - result['baseline']) / 1e6:6.0f} MB",
                        flush=True,
                    )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    body = report(header, written, args, results)
    print(body)
    if not args.no_docs:
        write_section("big-model-load", body)


def report(header: str, written: dict, args: argparse.Namespace, results: dict[tuple[str, str], list[dict]]) -> str:
    accelerate_version = subprocess.run(
        [ACCELERATE_PYTHON, "-c", "import accelerate; print(accelerate.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    load_now = os.getloadavg()[0]
    rows = []
    titles = {
        "cpu": 'all in CPU memory (`device_map={"": "cpu"}`)',
        "disk": f'`device_map="auto"`, `max_memory={{"cpu": "{args.budget}"}}`, rest on disk',
    }
    for setup in ("cpu", "disk"):
        for api in ("accel", "Accelerate"):
            runs = results[(setup, api)]
            load = med([r["load_seconds"] for r in runs])
            fwd = med([r["forward_seconds"] for r in runs])
            both = med([r["load_seconds"] + r["forward_seconds"] for r in runs])
            peak = med([(r["peak"] - r["baseline"]) / 1e6 for r in runs])
            placed = ", ".join(f"{k}: {v}" for k, v in sorted(runs[0]["placed"].items()))
            rows.append(f"| {titles[setup]} | {api} | {load:.2f} | {fwd:.2f} | {both:.2f} | {peak:.0f} | {placed} |")
    return "\n".join(
        [
            "## Big-model loading: `load_checkpoint_and_dispatch`, accel vs Accelerate",
            "",
            f"{header}; Accelerate {accelerate_version}; load average at the end {load_now:.1f}",
            "",
            f"Checkpoint: {written['layers']} residual MLP blocks of width {written['width']} (fp32), "
            f"{written['total_size'] / 1e9:.2f} GB in 4 safetensors shards with an index (Hugging Face's layout), in "
            f"the page cache (written just before). Each run is a fresh process (plugins/bigmodel/tests/scripts/big_model_probe.py): "
            f"`init_empty_weights`, `load_checkpoint_and_dispatch(..., no_split_module_classes=['Block'])`, one forward "
            f"of a (2, 8, {written['width']}) batch, equal bit for bit to the fully loaded model's output in every run. "
            f"Medians of {args.repeats} alternating runs (load + forward: median of the per-run sums); peak RSS is `ru_maxrss` minus the same process's after its "
            f"imports.",
            "",
            "| set-up | library | load (s) | first forward (s) | load + forward (s) | peak RSS over baseline (MB) | "
            "device map entries |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


if __name__ == "__main__":
    main()
