"""How each ported example is run (arguments, launch flags, sizes), shared by test_examples.py and
compare_accelerate.py. Sizes are small: 2 processes, tiny models, a few dozen optimizer steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import Case

#: hyper-parameters the text examples get through COMPAT_CONFIG: a learning rate at which the tiny BERT learns the
#: synthetic task within the run (the examples' 2e-5 is for a pretrained bert-base-cased)
TEXT = {"lr": 2e-2}
#: the image examples: 32x32 images, 8 a batch
IMAGES = {"image_size": 32, "batch_size": 8, "lr": 0.1}

CASES: dict[str, Case] = {
    "nlp_example": Case("nlp_example.py", config=TEXT, train_size=256),
    "nlp_example_bf16": Case("nlp_example.py", flags=["--mixed_precision", "bf16"], config=TEXT, train_size=256),
    "nlp_example_fp16": Case("nlp_example.py", flags=["--mixed_precision", "fp16"], config=TEXT, train_size=256),
    "nlp_example_fsdp": Case("nlp_example.py", flags=["--plugin", "fsdp"], config=TEXT, train_size=256),
    "complete_nlp_example": Case(
        "complete_nlp_example.py",
        args=["--checkpointing_steps", "epoch", "--output_dir", "ckpt", "--with_tracking", "--project_dir", "logs"],
        config=TEXT,
        train_size=256,
    ),
    "cv_example": Case("cv_example.py", args=["--data_dir", "pets"], config=IMAGES),
    "complete_cv_example": Case(
        "complete_cv_example.py",
        args=["--data_dir", "pets", "--checkpointing_steps", "epoch", "--output_dir", "ckpt"],
        config=IMAGES,
    ),
    "gradient_accumulation": Case(
        "gradient_accumulation.py", args=["--gradient_accumulation_steps", "2"], config=TEXT, train_size=288
    ),
    "checkpointing": Case(
        "checkpointing.py", args=["--checkpointing_steps", "3", "--output_dir", "ckpt"], config=TEXT, train_size=224
    ),
    "cross_validation": Case("cross_validation.py", args=["--num_folds", "2"], config=TEXT, train_size=192),
    "ddp_comm_hook": Case("ddp_comm_hook.py", args=["--ddp_comm_hook", "fp16"], config=TEXT, train_size=256),
    "ddp_comm_hook_power_sgd": Case(
        "ddp_comm_hook.py",
        args=["--ddp_comm_hook", "power_sgd", "--ddp_comm_wrapper", "no"],
        config=TEXT,
        train_size=256,
    ),
    # batched_power_sgd is refused by accel on this torch (its hook fails at the first compressed step), the bf16
    # wrapper on CPU (torch's bf16 hook needs CUDA+NCCL or XPU+XCCL): both with one clear line
    "ddp_comm_hook_fp16_wrapper": Case(
        "ddp_comm_hook.py",
        args=["--ddp_comm_hook", "power_sgd", "--ddp_comm_wrapper", "fp16"],
        config=TEXT,
        train_size=256,
    ),
    "early_stopping": Case(
        "early_stopping.py", train_size=256
    ),  # the example's lr: the loss stalls, the callback fires
    "local_sgd": Case("local_sgd.py", args=["--local_sgd_steps", "4"], config=TEXT, train_size=256),
    "memory": Case("memory.py", config=TEXT, train_size=256),
    "automatic_gradient_accumulation": Case(
        "automatic_gradient_accumulation.py", config={**TEXT, "batch_size": 32}, train_size=256
    ),
    "multi_process_metrics": Case("multi_process_metrics.py", config=TEXT, train_size=256, eval_size=70),
    "profiler": Case(
        "profiler.py", args=["--output_trace_dir", "traces", "--record_shapes"], config=TEXT, train_size=128
    ),
    "schedule_free": Case("schedule_free.py", config=TEXT, train_size=256),
    "tracking": Case("tracking.py", args=["--with_tracking", "--project_dir", "logs"], config=TEXT, train_size=256),
    "gradient_accumulation_for_autoregressive_models": Case(
        "gradient_accumulation_for_autoregressive_models.py",
        args=["--gradient_accumulation_steps", "2", "--per_device_batch_size", "8"],
        config={"lr": 5e-3, "num_epochs": 2},
        train_size=500,
        eval_size=64,
    ),
    "fsdp_with_peak_mem_tracking": Case(
        "fsdp_with_peak_mem_tracking.py",
        flags=["--plugin", "fsdp"],
        args=["--model_name_or_path", "bert-base-cased", "--output_dir", "ckpt", "--checkpointing_steps", "epoch"],
        config=TEXT,
        train_size=256,
    ),
}

# examples/inference/distributed
CASES["phi2"] = Case("phi2.py")
CASES["stable_diffusion"] = Case("stable_diffusion.py")
CASES["distributed_image_generation"] = Case(
    "distributed_image_generation.py",
    args=["--batch_size", "2", "--num_inference_steps", "2", "--dtype", "fp32", "--save_dir", "images"],
    eval_size=6,
)
CASES["distributed_speech_generation"] = Case(
    "distributed_speech_generation.py",
    args=["--output_path", "speech", "--batch_size", "1", "--num_workers", "1"],
    eval_size=7,
)

_CLM = [
    "--dataset_name",
    "wikitext",
    "--dataset_config_name",
    "wikitext-2-raw-v1",
    "--model_name_or_path",
    "gpt2",
    "--per_device_train_batch_size",
    "4",
    "--per_device_eval_batch_size",
    "4",
    "--num_train_epochs",
    "2",
    "--block_size",
    "32",
    "--learning_rate",
    "5e-3",
    "--num_warmup_steps",
    "4",
    "--seed",
    "42",
    "--output_dir",
    "out",
    "--load_best_model",
]
for stage in ("2", "3"):
    CASES[f"deepspeed_with_config_support_zero{stage}"] = Case(
        "deepspeed_with_config_support.py",
        args=_CLM,
        flags=["--plugin", "deepspeed", "--zero_stage", stage],
        train_size=96,
        eval_size=24,
    )
CASES["deepspeed_with_config_support_ddp"] = Case(
    "deepspeed_with_config_support.py", args=_CLM, train_size=96, eval_size=24
)

#: A DeepSpeed config file with its own optimizer and scheduler (DummyOptim / DummyScheduler in the example),
#: in the shape of Accelerate's examples/deepspeed_config_templates/zero_stage2_config.json.
DS_CONFIG: dict[str, Any] = {
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True, "adam_w_mode": True},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": 1,
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def write_ds_config(directory: Path) -> Path:
    path = directory / "ds_config.json"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(DS_CONFIG, indent=1))
    return path


CASES["deepspeed_with_config_support_config_file"] = Case(
    "deepspeed_with_config_support.py",
    args=_CLM,
    flags=["--plugin", "deepspeed", "--deepspeed_config_file", "ds_config.json"],
    train_size=96,
    eval_size=24,
)
