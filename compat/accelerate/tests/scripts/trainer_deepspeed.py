"""transformers' Trainer with ``TrainingArguments(deepspeed={ZeRO config dict})`` (``--zero 2`` or ``--zero 3``), or
plain DDP (``--zero`` left out), on a small regression network: y = w . x + noise, learnt by two linear layers.
Run unchanged under ``accel launch`` or under Accelerate (torchrun); it writes ``result-<process>.json`` into OUT:
the logged losses and gradient norms, the trained weights' norm (gathered), the evaluation loss, the checkpoint's
files and what this process holds of the parameters and of the optimizer states (how ZeRO partitioned them).

    trainer_deepspeed.py OUT [--zero 2|3] [--steps N] [--accumulate K] [--save-steps N] [--resume-from CHECKPOINT]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

FEATURES = 8


class Regression(torch.utils.data.Dataset):
    def __init__(self, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, FEATURES, generator=g)
        w = torch.linspace(-1.0, 1.0, FEATURES)
        self.y = self.x @ w + 0.1 * torch.randn(length, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class NetConfig(PretrainedConfig):
    def __init__(self, hidden_size: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hidden_size = hidden_size


class Net(PreTrainedModel):
    config_class = NetConfig

    def __init__(self, config: NetConfig) -> None:
        super().__init__(config)
        self.inner = nn.Linear(FEATURES, config.hidden_size)
        self.outer = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass  # nn.Linear's own initialisation, drawn from the seeded generator

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        y = self.outer(torch.tanh(self.inner(x))).squeeze(-1)
        if labels is None:
            return (y,)
        return (nn.functional.mse_loss(y.float(), labels.float()), y)


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []
        self.grad_norms: list[tuple[int, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append((state.global_step, float(logs["loss"])))
            if "grad_norm" in logs:
                self.grad_norms.append((state.global_step, float(logs["grad_norm"])))


def deepspeed_config(stage: int) -> dict[str, Any]:
    """A ZeRO config as transformers' docs write one: everything the Trainer knows left to "auto"."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition even the smallest parameters
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # Accelerate's get_state_dict needs it
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
    }


def holdings(trainer: Trainer) -> dict[str, Any]:
    """What this process holds: the parameters' local and full sizes, the optimizer states' size."""
    params = list(trainer.model.parameters())
    local = sum(p.numel() for p in params)
    full = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
    engine = getattr(trainer.model_wrapped, "optimizer", None)  # DeepSpeed's ZeRO optimizer, where there is one
    base = getattr(engine, "optimizer", None) or trainer.optimizer
    while hasattr(base, "optimizer") and not isinstance(base, torch.optim.Optimizer):
        base = base.optimizer
    state = sum(t.numel() for s in base.state.values() for k, t in s.items() if k == "exp_avg")
    return {
        "param_numel_local": local,
        "param_numel_full": full,
        "ds_params": sum(hasattr(p, "ds_numel") for p in params),
        "params": len(params),
        "exp_avg_numel": state,
        "zero_optimizer": type(engine).__name__ if engine is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    args = parser.parse_args()
    training = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate,
        max_steps=args.steps,
        learning_rate=0.05,
        max_grad_norm=1.0,
        logging_steps=1,
        save_steps=args.save_steps,
        save_strategy="steps",
        report_to=[],
        seed=42,
        use_cpu=True,
        bf16=args.mixed_precision == "bf16",
        dataloader_num_workers=0,
        deepspeed=deepspeed_config(args.zero) if args.zero is not None else None,
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    model = Net(NetConfig())
    record = Record()
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Regression(64, seed=1),
        eval_dataset=Regression(16, seed=2),
        callbacks=[record],
    )
    trainer.train(resume_from_checkpoint=args.resume_from)
    held = holdings(trainer)
    metrics = trainer.evaluate()
    weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # gathered from the partitions
    main = trainer.args.process_index == 0  # where the gathered weights are (under ZeRO-3 on Accelerate too)
    import accelerate

    row = {
        "process": trainer.args.process_index,
        "world": trainer.args.world_size,
        "accelerate": accelerate.__file__,
        "losses": record.losses,
        "grad_norms": record.grad_norms,
        "weight_norm": float(torch.cat([v.float().flatten() for v in weights.values()]).norm()) if main else None,
        "eval_loss": metrics["eval_loss"],
        "checkpoints": sorted(os.listdir(training.output_dir)),
        **held,
    }
    with open(os.path.join(args.out, f"result-{trainer.args.process_index}.json"), "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    main()
