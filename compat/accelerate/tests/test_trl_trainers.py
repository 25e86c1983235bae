"""TRL 1.16's ``DPOTrainer`` (full fine-tuning against a frozen copy, and a PEFT LoRA adapter against the
adapter-disabled model) and ``GRPOTrainer`` (a Python reward function, generation with ``model.generate`` on CPU),
unchanged, under ``accel launch -n 1``/``-n 2`` on accel-accelerate and under Hugging Face Accelerate 1.15 itself
(``scripts/trl_trainers.py``; the runs as in ``test_accelerate_facade.py``)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from test_accelerate_facade import HERE, launched

SCRIPT = HERE / "scripts" / "trl_trainers.py"
COMPARED = ("world", "logs", "completions", "weights", "changed", "lora_parameters", "lora_b_norm", "reference")


def both(tmp_path: Any, processes: int, *args: str) -> tuple[list, list]:
    """The rows of the run under accel launch and of the run under Accelerate (wall times printed)."""
    rows = []
    for name, real in (("accel", False), ("accelerate", True)):
        start = time.perf_counter()
        rows.append(launched(SCRIPT, tmp_path, name, processes, real, *args))
        print(f"{name} {' '.join(args)} -n {processes}: {time.perf_counter() - start:.1f} s")
    return rows[0], rows[1]


def test_logger_warning_once_logs_each_message_once(caplog: pytest.LogCaptureFixture) -> None:
    """``get_logger(...).warning_once``, which TRL's trainers call while tokenizing: Accelerate's, a message with the
    same arguments logged once."""
    from accelerate.logging import get_logger

    logger = get_logger("trl_trainers_test")
    with caplog.at_level(logging.WARNING, logger="trl_trainers_test"):
        for message in ("a prompt is cut", "a prompt is cut", "another", "a prompt is cut"):
            logger.warning_once(message)
    assert [record.getMessage() for record in caplog.records] == ["a prompt is cut", "another"]


def compared(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: row[k] for k in COMPARED} for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_trainer_trains_as_on_accelerate(tmp_path: Any, processes: int, lora: bool) -> None:
    """Four optimizer steps of two accumulated micro-batches: every logged loss, gradient norm, implicit reward,
    margin and log-probability is Accelerate's, bit for bit, and so are the weights after the last step (a sum over
    them), the names of the parameters that changed and the LoRA B norm. TRL's configs train in bf16, so the reference forward (``ref_model``, or ``self.model`` with the adapter
    disabled) runs in the autocast as the policy does: at the first step policy and reference are the same weights
    and the rewards are exactly 0."""
    ours, theirs = both(tmp_path, processes, "--trainer", "dpo", *(["--lora"] if lora else []))
    assert compared(ours) == compared(theirs)
    first = ours[0]
    assert first["world"] == processes and [row["step"] for row in first["logs"]] == [1, 2, 3, 4]
    assert first["logs"][0]["rewards/chosen"] == first["logs"][0]["rewards/rejected"] == 0.0
    assert first["logs"][-1]["rewards/margins"] != 0.0
    if lora:
        assert first["changed"] == [] and first["lora_b_norm"] > 0 and first["reference"] is None
    else:
        assert "lm_head.weight" in first["changed"] and first["reference"] == "GPT2LMHeadModel"


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_trainer_trains_as_on_accelerate(tmp_path: Any, processes: int, lora: bool) -> None:
    """Four steps of 4 completions per prompt (one prompt per process per step), sampled at temperature 1 by
    ``model.generate`` and scored by their length: every process generates the same completions of the same
    prompts as under Accelerate, token for token, so every logged loss, gradient norm, reward, KL and entropy is
    Accelerate's, bit for bit, and so are the weights after the last step. Equal because every draw is: the prompts come from TRL's ``RepeatSampler`` (its own
    generator, seeded by ``args.seed``), sampling draws from the CPU generator that ``GRPOTrainer`` seeds with
    ``set_seed(seed, device_specific=True)`` (seed + process index, on both), and so do the dropout masks of the
    policy's training forwards (GRPO keeps GPT-2's dropout), in the same order: the completions of steps 2-4 are
    equal only if those draws are. The KL term (``beta=0.04``) is against a reference model prepared for
    evaluation (full fine-tuning) or the adapter-disabled model (LoRA), in the autocast as under Accelerate."""
    ours, theirs = both(tmp_path, processes, "--trainer", "grpo", *(["--lora"] if lora else []))
    assert compared(ours) == compared(theirs)
    first = ours[0]
    assert first["world"] == processes and [row["step"] for row in first["logs"]] == [1, 2, 3, 4]
    for row in ours:  # 4 steps x 4 completions of the process's one prompt per step
        assert len(row["completions"]) == 16 and len({prompt for prompt, _ in row["completions"]}) == 4
    if processes == 2:  # the sampler gave each process its own prompts
        assert {p for p, _ in ours[0]["completions"]}.isdisjoint({p for p, _ in ours[1]["completions"]})
    if lora:
        assert first["changed"] == [] and first["lora_b_norm"] > 0 and first["reference"] is None
    else:
        assert "lm_head.weight" in first["changed"] and first["reference"] == "GPT2LMHeadModel"
