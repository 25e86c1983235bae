"""TRL's ``SFTTrainer`` (with a PEFT LoRA adapter, ``--lora``) on a tiny GPT-2 built from a config and a word-level
tokenizer made offline, over an in-memory text dataset, as TRL's own SFT tests build theirs (tests/test_sft_trainer.py:
a tiny model, ``SFTConfig(max_steps=..., report_to="none")``, a ``LoraConfig``). Unchanged under ``python``, under
``accel launch`` and under Accelerate; writes ``result-<process>.json`` into OUT: the logged losses and which
parameters changed.

    sft_lora.py OUT [--lora] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback

WORDS = "the a cat dog sat ran on under mat log fast slow red blue big small and then".split()


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_gpt2(tok: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 for ``tok``'s vocabulary, its weights drawn after ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    return GPT2LMHeadModel(config)


def texts(n: int = 48) -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (8,), generator=g)) for _ in range(n)]
    return Dataset.from_dict({"text": rows})


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_log(self, args: object, state: object, control: object, logs: dict | None = None, **kw: object) -> None:
        if logs and "loss" in logs:
            self.losses.append((state.global_step, float(logs["loss"])))  # type: ignore[attr-defined]


def main() -> None:
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fsdp", default="", help="TrainingArguments(fsdp=...), e.g. 'full_shard'")
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--resume-from", default=None)
    args = parser.parse_args()
    tok = tokenizer()
    model = tiny_gpt2(tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    training = SFTConfig(
        output_dir=os.path.join(args.out, "sft"),
        max_steps=args.steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=args.save_steps,
        fsdp=args.fsdp,
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]} if args.fsdp else None,
        max_length=16,
        report_to="none",
        use_cpu=True,
        seed=42,
        disable_tqdm=True,
    )
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM") if args.lora else None
    record = Losses()
    trainer = SFTTrainer(
        model=model,
        args=training,
        train_dataset=texts(),
        processing_class=tok,
        peft_config=peft_config,
        callbacks=[record],
    )
    trainer.train(resume_from_checkpoint=args.resume_from)
    trained = trainer.model
    full = trainer.accelerator.get_state_dict(trained)  # gathered from the shards under FSDP
    after = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in full.items()}
    changed = sorted(name for name, value in before.items() if name in after and not torch.equal(value, after[name]))
    sharded = any(type(p).__name__ == "DTensor" for p in trained.parameters())
    import accelerate

    row = {
        "process": trainer.args.process_index,
        "world": trainer.args.world_size,
        "accelerate": accelerate.__file__,
        "losses": record.losses,
        "changed": changed,
        "lora_parameters": sorted(n for n, _ in trained.named_parameters() if "lora_" in n),
        "lora_b_norm": sum(float(p.detach().norm()) for n, p in trained.named_parameters() if "lora_B" in n),
        "sharded": sharded,
        "parameters_changed": len(changed),
        "checkpoints": sorted(os.listdir(training.output_dir)),
    }
    with open(os.path.join(args.out, f"result-{trainer.args.process_index}.json"), "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    main()
