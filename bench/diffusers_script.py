"""diffusers' ``train_unconditional.py``, unchanged, on accel-accelerate against Hugging Face Accelerate 1.15: 2
processes, a tiny UNet (tests/compat's), EMA, a checkpoint every 2 steps saved by the main process alone
(``if accelerator.is_main_process: accelerator.save_state(...)``), 2 epochs; each run in processes of its own,
alternated A B A B ...; the wall time from launch to exit.

    python bench/diffusers_script.py [--repeats 3] [--no-write]

Writes the ``diffusers-script`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import free_port, machine, write_section
from trainer_step import REAL, clean_env

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "tests" / "compat"
UPSTREAM = COMPAT / "upstream" / "diffusers" / "examples" / "unconditional_image_generation" / "train_unconditional.py"
ARGS = (
    "--train_data_dir images --model_config_name_or_path unet --resolution 16 --train_batch_size 4 "
    "--eval_batch_size 2 --num_epochs 2 --save_images_epochs 1 --save_model_epochs 1 --learning_rate 1e-3 "
    "--lr_warmup_steps 2 --ddpm_num_steps 50 --ddpm_num_inference_steps 2 --checkpointing_steps 2 "
    "--checkpoints_total_limit 2 --use_ema --output_dir ddpm"
).split()


def prepare(folder: Path) -> None:
    sys.path.insert(0, str(COMPAT))
    from test_upstream_ports import IMAGES, make_images, make_unet_config

    make_images(folder / "images", IMAGES)
    make_unet_config(folder / "unet")


def one_run(impl: str, data: Path) -> float:
    with tempfile.TemporaryDirectory() as out:
        for name in ("images", "unet"):
            shutil.copytree(data / name, Path(out) / name)
        env = clean_env(COMPAT_TORCHVISION_STANDIN=str(COMPAT / "offline"))
        env["PYTHONPATH"] = f"{COMPAT / 'record'}{os.pathsep}{COMPAT}"
        if impl == "accel":
            cmd = [
                sys.executable,
                "-m",
                "accel.commands.cli",
                "launch",
                "-n",
                "2",
                "-q",
                "--main_process_port",
                str(free_port()),
                str(UPSTREAM),
                *ARGS,
            ]
        else:
            env.update(ACCEL_ACCELERATE="0", ACCELERATE_USE_CPU="true")
            env["PYTHONPATH"] = f"{REAL}{os.pathsep}{env['PYTHONPATH']}"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=2",
                f"--master_port={free_port()}",
                str(UPSTREAM),
                *ARGS,
            ]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=900)
        seconds = time.perf_counter() - start
        if proc.returncode or not (Path(out) / "ddpm" / "checkpoint-8").is_dir():
            raise SystemExit(f"{impl} failed:\n{proc.stderr[-3000:]}")
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        prepare(Path(data))
        rounds: dict[str, list[float]] = {"accelerate": [], "accel": []}
        for _ in range(args.repeats):
            for impl in rounds:
                rounds[impl].append(one_run(impl, Path(data)))
    ratios = sorted(a / b for a, b in zip(rounds["accel"], rounds["accelerate"], strict=True))
    body = "\n".join(
        [
            "### diffusers' train_unconditional.py: accel-accelerate vs Accelerate 1.15",
            "",
            f"`python bench/diffusers_script.py --repeats {args.repeats}`: {machine()}. The unchanged upstream "
            "script on 2 processes (tiny UNet, EMA, 8 steps, a checkpoint every 2 steps saved by the main process "
            "alone, sampling and saving the pipeline each epoch), launch to exit, medians; ratio = accel time / "
            "Accelerate time per round (below 1: accel is faster).",
            "",
            "| Accelerate s | accel s | ratio | range |",
            "|---|---|---|---|",
            f"| {statistics.median(rounds['accelerate']):.1f} | {statistics.median(rounds['accel']):.1f} | "
            f"**{statistics.median(ratios):.3f}** | {ratios[0]:.3f}-{ratios[-1]:.3f} |",
        ]
    )
    print(body)
    if not args.no_write:
        write_section("diffusers-script", body)


if __name__ == "__main__":
    main()
