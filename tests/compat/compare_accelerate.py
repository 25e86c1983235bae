"""Run ported examples under accel and under Accelerate 1.15 and compare what they did.

    python tests/compat/compare_accelerate.py --accelerate-python .venv-compat-accelerate/bin/python [NAME ...]

(``make compat-vs-accelerate`` builds that venv and runs this.) For each example (default: every one in
``COMPARED``) it prints whether the learning rate at every optimizer step is the same on both processes (required:
exit status 1 otherwise), and whether the training losses and the printed metrics are the same too (they are when
both libraries hand the processes the same batches in the same order; reported, not required).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compat_offline  # noqa: E402
from cases import CASES, write_ds_config  # noqa: E402
from harness import Case, Run, run_accel, run_accelerate  # noqa: E402

#: the examples compared by default: they run under both libraries on CPU with the same flags
COMPARED = [
    "nlp_example",
    "nlp_example_bf16",
    "gradient_accumulation",
    "checkpointing",
    "tracking",
    "memory",
    "multi_process_metrics",
    "cv_example",
    "early_stopping",
    "local_sgd",
    "schedule_free",
    "gradient_accumulation_for_autoregressive_models",
    "cross_validation",
    "nlp_example_fsdp",
]
# Not compared: DeepSpeed under Accelerate 1.15 on CPU. With ACCELERATE_USE_CPU it runs plain multi-CPU DDP (the
# DeepSpeed variables are ignored); without it DeepSpeed's batch check fails ("train_batch_size is not equal to
# micro_batch_per_gpu * gradient_acc_step * world_size 4 != 4 * 1 * 2").


def _prepare(case: Case, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if "pets" in case.args:
        compat_offline.make_pets(out / "pets")
    if "ds_config.json" in case.flags:
        write_ds_config(out)


def _records(result: Run) -> list[dict[str, list[Any]]] | None:
    try:
        return [result.record(rank) for rank in range(2)]
    except AssertionError:
        return None


def compare(name: str, workdir: Path, python: str) -> dict[str, Any]:
    """Run ``CASES[name]`` under both libraries in ``workdir`` and compare."""
    case = CASES[name]
    runs = {}
    for lib in ("accel", "accelerate"):
        out = workdir / name / lib
        shutil.rmtree(out, ignore_errors=True)
        _prepare(case, out)
        runs[lib] = run_accel(case, out) if lib == "accel" else run_accelerate(case, out, python)
    report: dict[str, Any] = {"example": name, **{f"{lib}_exit": r.returncode for lib, r in runs.items()}}
    recs = {lib: _records(r) for lib, r in runs.items()}
    if any(r.returncode != 0 or recs[lib] is None for lib, r in runs.items()):
        failed = [lib for lib, r in runs.items() if r.returncode != 0 or recs[lib] is None]
        report.update(lrs_equal=False, error={lib: runs[lib].stderr[-1500:] for lib in failed})
        return report
    a, b = recs["accel"], recs["accelerate"]
    assert a is not None and b is not None
    report["optimizer_steps"] = [len(a[0]["lrs"]), len(b[0]["lrs"])]
    report["lrs_equal"] = all(a[rank]["lrs"] == b[rank]["lrs"] for rank in range(2))
    if not report["lrs_equal"]:
        report["lrs"] = {"accel": [g[0] for g in a[0]["lrs"]], "accelerate": [g[0] for g in b[0]["lrs"]]}
    report["losses_equal"] = all(a[rank]["losses"] == b[rank]["losses"] for rank in range(2))
    report["first_loss_equal"] = bool(a[0]["losses"][:1] == b[0]["losses"][:1])
    report["metrics_equal"] = runs["accel"].epochs() == runs["accelerate"].epochs()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerate-python", required=True, help="python of a venv with accelerate 1.15")
    parser.add_argument("--workdir", default=None, help="where the runs write (default: a temporary directory)")
    parser.add_argument("names", nargs="*", default=COMPARED, help=f"examples (default: {' '.join(COMPARED)})")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="accel-compat-"))
    failed = 0
    for name in args.names:
        report = compare(name, workdir, args.accelerate_python)
        failed += not report["lrs_equal"]
        verdict = "same LR curve" if report["lrs_equal"] else "LR CURVE DIFFERS"
        extra = {k: v for k, v in report.items() if k not in ("example", "lrs_equal")}
        print(f"{name}: {verdict} {json.dumps(extra)[:3000]}", flush=True)
    print(
        f"{len(args.names) - failed}/{len(args.names)} examples with Accelerate's learning-rate curve "
        f"(runs in {workdir})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
