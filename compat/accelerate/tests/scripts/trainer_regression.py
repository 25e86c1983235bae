"""transformers' Trainer on a regression model, as transformers' own tests/trainer/test_trainer.py builds it
(``RegressionDataset``, ``RegressionPreTrainedModel``, ``get_regression_trainer``), ported: y = a*x + b + noise,
a model of two scalars. Run unchanged under ``python`` or ``accel launch``; it writes one JSON line per process to
``--out``: the losses logged at each step, the trained a and b, the evaluation loss.

    trainer_regression.py OUT_DIR [--steps N] [--accumulate K] [--resume-from CHECKPOINT] [--save-steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments


class RegressionDataset:
    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int = 42) -> None:
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.ys = [a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, float]:
        return {"input_x": float(self.x[i]), "labels": float(self.ys[0][i])}


class RegressionModelConfig(PretrainedConfig):
    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.a = a
        self.b = b
        self.double_output = double_output
        self.hidden_size = 1


class RegressionPreTrainedModel(PreTrainedModel):
    config_class = RegressionModelConfig
    base_model_prefix = "regression"

    def __init__(self, config: RegressionModelConfig) -> None:
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(config.a).float())
        self.b = nn.Parameter(torch.tensor(config.b).float())
        self.post_init()

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: object) -> object:
        y = input_x * self.a + self.b
        if labels is None:
            return (y,)
        loss = nn.functional.mse_loss(y, labels)
        return (loss, y)


class Record(TrainerCallback):
    """The logged losses and gradient norms, and the time of the optimizer steps after the first ``warm``."""

    def __init__(self, warm: int = 2) -> None:
        self.losses: list[tuple[int, float]] = []
        self.grad_norms: list[tuple[int, float]] = []
        self.warm = warm
        self.times: list[float] = []

    def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
        if state.global_step >= self.warm:  # type: ignore[attr-defined]
            self.times.append(time.perf_counter())

    def on_log(self, args: object, state: object, control: object, logs: dict | None = None, **kwargs: object) -> None:
        if logs and "loss" in logs:
            self.losses.append((state.global_step, logs["loss"]))  # type: ignore[attr-defined]
            if "grad_norm" in logs:
                self.grad_norms.append((state.global_step, float(logs["grad_norm"])))  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--mixed-precision", default="no")
    parser.add_argument("--length", type=int, default=64, help="samples in the training set")
    parser.add_argument("--logging-steps", type=int, default=1)
    parser.add_argument("--fsdp", default="", help="TrainingArguments(fsdp=...), e.g. 'full_shard'")
    args = parser.parse_args()
    training = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate,
        max_steps=args.steps,
        learning_rate=0.1,
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        save_strategy="steps",
        report_to=[],
        seed=42,
        use_cpu=True,
        bf16=args.mixed_precision == "bf16",
        dataloader_num_workers=0,
        fsdp=args.fsdp,
        fsdp_config={"fsdp_version": 2} if args.fsdp else None,
        disable_tqdm=True,
    )
    model = RegressionPreTrainedModel(RegressionModelConfig(a=0, b=0))
    record = Record()
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=RegressionDataset(length=args.length),
        eval_dataset=RegressionDataset(length=16, seed=7),
        callbacks=[record],
    )
    trainer.train(resume_from_checkpoint=args.resume_from)
    metrics = trainer.evaluate()
    import accelerate

    row = {
        "process": trainer.args.process_index,
        "world": trainer.args.world_size,
        "accelerate": accelerate.__file__,
        "losses": record.losses,
        "grad_norms": record.grad_norms,
        "a": float(model.a),
        "b": float(model.b),
        "eval_loss": metrics["eval_loss"],
        "checkpoints": sorted(os.listdir(training.output_dir)),
        "steps_per_second": (len(record.times) - 1) / (record.times[-1] - record.times[0])
        if len(record.times) > 1
        else None,
    }
    with open(os.path.join(args.out, f"result-{trainer.args.process_index}.json"), "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    main()
