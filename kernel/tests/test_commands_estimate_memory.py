"""accel.commands.estimate_memory, with no plugin needed: ``--help`` without torch, a Hugging Face config.json
(file or directory) counted as transformers builds it, and every kind of bad input one line on stderr with exit 2.
The strategies' rows (DDP, FSDP, DeepSpeed, XLA, parallel) and the comparison with memory measured in real runs are
in tests/test_estimate_memory.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accel.testing import isolated_env


def find(rows: list[dict[str, Any]], strategy: str, options: str, dtype: str) -> dict[str, Any]:
    match = [r for r in rows if r["strategy"] == strategy and r["options"] == options and r["dtype"] == dtype]
    assert len(match) == 1, (strategy, options, dtype, [(r["strategy"], r["options"], r["dtype"]) for r in rows])
    return match[0]


def test_help_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom accel.commands.cli import main\n"
        "try:\n    main(['estimate-memory', '--help'])\nexcept SystemExit as exc:\n    assert exc.code == 0\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=isolated_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "--num_processes" in result.stdout and "--dtypes" in result.stdout and "TORCH False" in result.stdout


@pytest.mark.slow  # imports transformers in a child interpreter: 17 s on the shared 2-core machine
def test_hugging_face_config_file_and_directory(tmp_path: Path) -> None:
    """A transformers config.json (no hub access): a 2-layer Llama with tied embeddings, counted once."""
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    embed, attn, mlp, norms = 1000 * 64, 64 * 64 * 2 + 64 * 32 * 2, 3 * 64 * 128, 2 * 64
    expected = embed + 2 * (attn + mlp + norms) + 64
    env = isolated_env(tmp_path / "home", extra={"HF_HUB_OFFLINE": "1"})
    code = (
        "import sys\nfrom accel.commands.cli import main\n"  # one interpreter: transformers is imported once
        "for target in sys.argv[1:]:\n    assert main(['estimate-memory', target, '--json', '-n', '2']) == 0\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(folder), str(folder / "config.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    decoder, text, outputs = json.JSONDecoder(), result.stdout.strip(), []
    while text:
        data, end = decoder.raw_decode(text)
        outputs.append(data)
        text = text[end:].strip()
    assert len(outputs) == 2
    for data in outputs:
        assert data["parameters"] == expected and data["largest_layer_parameters"] == embed
        assert find(data["rows"], "single process", "-", "fp32")["total"] == 16 * expected


@pytest.mark.parametrize(
    "case,message",
    [
        (
            "no_module:net",
            "accel: error: MODEL 'no_module:net': no module named 'no_module' (run from the directory "
            "that holds it, or set PYTHONPATH)",
        ),
        (
            "broken_model:net",
            "accel: error: MODEL 'broken_model:net': importing 'broken_model' failed: ZeroDivisionError: "
            "division by zero (at broken_model.py:2)",
        ),
        ("estimate_model:nope", "accel: error: MODEL 'estimate_model:nope': 'estimate_model' has no attribute 'nope'"),
        (
            "failing_model:net",
            "accel: error: MODEL 'failing_model:net': calling net() on the meta device failed: "
            "ValueError: width must be positive (at failing_model.py:5)",
        ),
        (
            "bad.json",
            "accel: error: MODEL 'bad.json': bad.json is not valid JSON: Expecting value: line 1 column 16 (char 15)",
        ),
        (
            "nomodel.json",
            "accel: error: MODEL 'nomodel.json': nomodel.json has no \"model_type\"; is it a Hugging Face "
            "model config.json?",
        ),
        (
            "deep.json",
            "accel: error: MODEL 'deep.json': deep.json is nested too deeply to be a model config (Python's "
            "recursion limit was reached reading it); give the model's own config.json",
        ),
        (
            "archs.json",
            "accel: error: MODEL 'archs.json': archs.json: \"architectures\" must be a list of class names "
            "(e.g. [\"LlamaForCausalLM\"]), got 'GPT2LMHeadModel'",
        ),
        (
            "layers.json",
            "accel: error: MODEL 'layers.json': layers.json: \"num_hidden_layers\" must be a whole number of "
            "layers from 0 to 4096, got 1000000.0",
        ),
        (
            "empty_dir",
            "accel: error: MODEL 'empty_dir': directory has no config.json (give a Hugging Face config.json "
            "file or its directory)",
        ),
        (
            "gpt2",
            "accel: error: MODEL 'gpt2' is neither an import path (pkg.module:factory) nor an existing config.json "
            "file or directory",
        ),
        (
            "estimate_model:net --dtypes int4",
            "accel: error: --dtypes: unknown dtype 'int4'; choose from fp32, bf16, "
            "fp16, fp8 (training memory; int8/int4 are inference formats)",
        ),
    ],
)
def test_bad_input_is_one_line(
    tmp_path: Path, case: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real command (`accel`'s main), in this process: one line on stderr, exit 2, nothing on stdout."""
    from accel.commands.cli import main

    (tmp_path / "broken_model.py").write_text("import torch\nRATIO = 1 / 0\n")
    (tmp_path / "failing_model.py").write_text(
        "from torch import nn\n\n\ndef net(width=-1):\n    raise ValueError('width must be positive')\n"
    )
    (tmp_path / "bad.json").write_text('{"model_type": }')
    (tmp_path / "nomodel.json").write_text('{"hidden_size": 8}')
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "archs.json").write_text('{"model_type": "gpt2", "architectures": "GPT2LMHeadModel"}')
    (tmp_path / "layers.json").write_text('{"model_type": "gpt2", "num_hidden_layers": 1e6}')
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "estimate_model.py").write_text("from torch import nn\n\n\ndef net():\n    return nn.Linear(4, 2)\n")
    monkeypatch.chdir(tmp_path)
    try:
        assert main(["estimate-memory", *case.split()]) == 2
    finally:  # the user's modules imported here go away afterwards
        for name in ("broken_model", "failing_model", "estimate_model"):
            sys.modules.pop(name, None)
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if line.strip()] == [message] and captured.out == ""
