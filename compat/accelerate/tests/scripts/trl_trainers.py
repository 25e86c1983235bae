"""TRL's ``DPOTrainer`` (with a PEFT LoRA adapter, ``--lora``: the adapter-disabled model is then the reference) and
``GRPOTrainer`` (a reward function in Python, generation with ``model.generate`` on CPU, no vLLM) on a tiny GPT-2 built
from a config and a word-level tokenizer made offline, over in-memory datasets, as TRL's own tests build theirs
(tests/test_dpo_trainer.py, tests/test_grpo_trainer.py: a tiny model, ``report_to="none"``, a few steps, a small
``num_generations``). Unchanged under ``python``, under ``accel launch`` and under Accelerate; writes
``result-<process>.json`` into OUT: the logged losses and gradient norms (DPO: implicit rewards, margins and
log-probabilities too; GRPO: the mean reward, the KL and the entropy), the completions this process generated and
scored, a sum over the trained weights, which parameters changed and the reference model's type (None: the
adapter-disabled model).

    trl_trainers.py OUT --trainer dpo|grpo [--lora] [--steps N]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from typing import Any

import torch
from datasets import Dataset
from sft_lora import WORDS, tiny_gpt2, tokenizer  # the same tiny model and tokenizer as the SFT script (beside it)
from transformers import TrainerCallback

#: what the logs keep of each trainer (TRL's names)
LOGGED = {
    "dpo": (
        "loss",
        "grad_norm",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ),
    "grpo": ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "entropy", "kl"),
}


def sentence(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=g))


def preferences(n: int = 32) -> Dataset:
    """TRL's "standard_preference" format: a prompt, a chosen and a rejected completion (which start with a space,
    as in TRL's test data, so the prompt's tokens are a prefix of the prompt+completion's)."""
    g = torch.Generator().manual_seed(0)
    rows = [(sentence(g, 4), " " + sentence(g, 4), " " + sentence(g, 4)) for _ in range(n)]
    return Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})


def prompts(n: int = 32) -> Dataset:
    """TRL's "standard_prompt_only" format."""
    g = torch.Generator().manual_seed(0)
    return Dataset.from_dict({"prompt": [sentence(g, 4) for _ in range(n)]})


class Logged(TrainerCallback):
    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.rows: list[dict[str, Any]] = []

    def on_log(self, args: object, state: object, control: object, logs: dict | None = None, **kw: object) -> None:
        if logs and "loss" in logs:
            step = state.global_step  # type: ignore[attr-defined]
            self.rows.append({"step": step, **{k: float(logs[k]) for k in self.keys if k in logs}})


class LengthReward:
    """A reward function in Python, as GRPO calls it (``completions`` plus the dataset's columns): the length of each
    completion's text. Remembers what this process scored, in order."""

    __name__ = "length"

    def __init__(self) -> None:
        self.scored: list[tuple[str, str]] = []

    def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        self.scored.extend(zip(prompts, completions, strict=True))
        return [float(len(c)) for c in completions]


def main() -> None:
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--trainer", choices=("dpo", "grpo"), required=True)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    tok = tokenizer()
    model = tiny_gpt2(tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    common: dict[str, Any] = {
        "output_dir": os.path.join(args.out, args.trainer),
        "max_steps": args.steps,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 42,
        "disable_tqdm": True,
    }
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM") if args.lora else None
    record = Logged(LOGGED[args.trainer])
    reward = LengthReward()
    trainer: Any
    if args.trainer == "dpo":
        training = DPOConfig(
            per_device_train_batch_size=2, gradient_accumulation_steps=2, beta=0.1, max_length=16, **common
        )
        trainer = DPOTrainer(
            model=model,
            # full fine-tuning: a frozen copy of the initial model; with LoRA none: the adapter-disabled model
            ref_model=None if args.lora else copy.deepcopy(model),
            args=training,
            train_dataset=preferences(),
            processing_class=tok,
            peft_config=peft_config,
            callbacks=[record],
        )
    else:
        training = GRPOConfig(
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            temperature=1.0,
            beta=0.04,  # a KL term against the reference model
            **common,
        )
        # full fine-tuning: GRPO builds its reference model from the policy's path (TRL's tests pass model ids), so
        # the tiny model is saved and passed by path; with LoRA the reference is the adapter-disabled model
        path = os.path.join(args.out, "tiny-gpt2")
        with training.main_process_first(desc="saving the tiny model"):  # transformers saves on rank 0 only
            if training.process_index == 0:
                model.save_pretrained(path)
        trainer = GRPOTrainer(
            model=model if args.lora else path,
            reward_funcs=reward,
            args=training,
            train_dataset=prompts(),
            processing_class=tok,
            peft_config=peft_config,
            callbacks=[record],
        )
    trainer.train()
    trained = trainer.accelerator.unwrap_model(trainer.model)
    after = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in trained.state_dict().items()}
    changed = sorted(name for name, value in before.items() if name in after and not torch.equal(value, after[name]))
    import accelerate

    row = {
        "process": trainer.args.process_index,
        "world": trainer.args.world_size,
        "accelerate": accelerate.__file__,
        "logs": record.rows,
        "completions": reward.scored,
        "changed": changed,
        "lora_parameters": sorted(n for n, _ in trained.named_parameters() if "lora_" in n),
        "lora_b_norm": sum(float(p.detach().norm()) for n, p in trained.named_parameters() if "lora_B" in n),
        "weights": sum(float(p.detach().double().abs().sum()) for p in trained.parameters()),  # after the last step
        "reference": type(trainer.ref_model).__name__ if getattr(trainer, "ref_model", None) is not None else None,
    }
    with open(os.path.join(args.out, f"result-{trainer.args.process_index}.json"), "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    main()
