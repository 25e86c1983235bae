"""Big-model inference (accel-plugin-bigmodel): init_empty_weights, infer_auto_device_map, load_checkpoint_and_dispatch
with CPU and disk offload, on a ~1 GB checkpoint in a fresh process (peak RSS against the budget), Hugging Face
``save_pretrained`` shards, ``Kernel.save_model`` output, and the errors a user acts on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from big_model_defs import TinyLM
from safetensors.torch import save_file
from torch import nn

import accel
from accel.utils import (
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)

HERE = Path(__file__).resolve().parent
PROBE = HERE / "scripts" / "big_model_probe.py"
ACCELERATE_PYTHON = Path(os.environ.get("ACCEL_TEST_ACCELERATE_PYTHON", "/work/venvs/acc/bin/python"))
BUDGET = 300 * 10**6  # "300MB"
# Over the budget we allow the loader's memory-map chunk (CHUNK_BYTES, 32 MiB) and the activations; measured on
# this machine: peak RSS - baseline = 262 MB for the 1.0 GB checkpoint, i.e. inside the budget itself.
MARGIN = 40 * 2**20


def _reference(tmp_path: Path, **kwargs: object) -> tuple[TinyLM, Path]:
    torch.manual_seed(0)
    model = TinyLM(**kwargs).eval()  # type: ignore[arg-type]
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight" or not kwargs.get("tied", True)}
    path = tmp_path / "ckpt" / "model.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, os.fspath(path))
    return model, path.parent


IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])


# ---- init_empty_weights / init_on_device -----------------------------------------------------------------------------


@pytest.mark.smoke
def test_init_empty_weights_puts_parameters_on_meta_and_keeps_ties_and_buffers() -> None:
    with init_empty_weights():
        model = TinyLM()
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.embed.weight  # the tie survives (assigning an existing meta parameter)
    assert not model.scale.is_meta and torch.equal(model.scale, torch.full((32,), 0.5))
    with init_empty_weights(include_buffers=True):
        model = TinyLM()
    assert model.scale.is_meta
    with init_on_device("cpu"):
        model = TinyLM()
    assert not any(p.is_meta for p in model.parameters())
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is gone after the context


# ---- loading small models over device maps --------------------------------------------------------------------------


@pytest.mark.smoke
@pytest.mark.parametrize("device_map", ["auto", "sequential", "balanced", "dict"])
def test_outputs_equal_the_fully_loaded_model(tmp_path: Path, device_map: str) -> None:
    model, ckpt = _reference(tmp_path)
    want = model(IDS)
    with init_empty_weights():
        empty = TinyLM()
    dmap: object = device_map
    if device_map == "dict":
        dmap = {
            "embed": "cpu",
            "blocks.0": "cpu",
            "blocks.1": "disk",
            "blocks.2": "cpu",
            "blocks": "disk",
            "head": "disk",
            "": "cpu",
        }
    budget = None if device_map == "dict" else {"cpu": 60_000}
    loaded = load_checkpoint_and_dispatch(
        empty,
        ckpt,
        device_map=dmap,
        max_memory=budget,  # type: ignore[arg-type]
        no_split_module_classes=["Block"],
        offload_folder=tmp_path / "off",
    )
    assert "disk" in loaded.hf_device_map.values() and "cpu" in loaded.hf_device_map.values()
    assert torch.equal(loaded(IDS), want)
    assert torch.equal(loaded(IDS), want)  # offloaded weights are released and loaded again
    disk = [n for n, p in loaded.named_parameters() if p.is_meta]
    assert disk, "disk-offloaded weights stay on meta between forwards"
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    assert set(disk) <= set(index)


def test_dtype_converts_and_offloaded_copies_go_to_the_offload_folder(tmp_path: Path) -> None:
    model, ckpt = _reference(tmp_path)
    want = model.to(torch.bfloat16)(IDS)
    with init_empty_weights():
        empty = TinyLM()
    # as with Accelerate, dtype converts what the checkpoint holds: a buffer computed at construction keeps its own
    empty.scale = empty.scale.to(torch.bfloat16)
    loaded = load_checkpoint_and_dispatch(
        empty,
        ckpt,
        device_map="auto",
        max_memory={"cpu": 30_000},
        no_split_module_classes=["Block"],
        offload_folder=tmp_path / "off",
        dtype="bfloat16",
    )
    assert loaded.embed.weight.dtype == torch.bfloat16
    assert torch.equal(loaded(IDS), want)
    copies = sorted(p.name for p in (tmp_path / "off").glob("*.safetensors"))
    assert "blocks.5.up.weight.safetensors" in copies


def test_infer_auto_device_map_reserves_the_largest_block_and_splits_what_it_may() -> None:
    with init_empty_weights():
        model = TinyLM(tied=False)
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    embed = 50 * 32 * 4
    everything = infer_auto_device_map(model, max_memory={"cpu": 10**9})
    assert dict(everything) == {"": "cpu"}
    dmap = infer_auto_device_map(
        model, max_memory={"cpu": embed + 2 * block + block + 1000}, no_split_module_classes=["Block"]
    )
    assert dict(dmap) == {
        "embed": "cpu",
        "blocks.0": "cpu",
        "blocks.1": "cpu",
        "blocks.2": "disk",
        "blocks.3": "disk",
        "blocks.4": "disk",
        "blocks.5": "disk",
        "head": "disk",
        "scale": "disk",
    }
    split = infer_auto_device_map(model, max_memory={"cpu": embed + block})  # blocks may be split: leaves are smaller
    assert any(name.count(".") == 2 for name in split)


@pytest.mark.skipif(not ACCELERATE_PYTHON.exists(), reason="Accelerate's venv (ACCEL_TEST_ACCELERATE_PYTHON) absent")
def test_infer_auto_device_map_agrees_with_accelerate() -> None:
    budgets = [40_000, 60_000, 150_000, 10**9]  # below the largest block (33.7 KB) accel refuses (docs/design.md)
    code = f"""
import json, sys, torch
sys.path.insert(0, {str(HERE)!r})
from accelerate import init_empty_weights
from accelerate.utils import infer_auto_device_map
from big_model_defs import TinyLM
with init_empty_weights():
    model = TinyLM(tied=False)
print(json.dumps([[dict(infer_auto_device_map(model, max_memory={{"cpu": b}}, no_split_module_classes=ns))
                   for b in {budgets}] for ns in ([], ["Block"])]))
"""
    result = subprocess.run([str(ACCELERATE_PYTHON), "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    with init_empty_weights():
        model = TinyLM(tied=False)
    ours = [
        [dict(infer_auto_device_map(model, max_memory={"cpu": b}, no_split_module_classes=ns)) for b in budgets]
        for ns in ([], ["Block"])
    ]
    assert ours == theirs


@pytest.mark.smoke
def test_load_checkpoint_in_model_then_dispatch_model_and_dispatch_of_a_loaded_model(tmp_path: Path) -> None:
    model, ckpt = _reference(tmp_path)
    want = model(IDS)
    dmap = {"embed": "cpu", "blocks.0": "cpu", "blocks": "disk", "head": "disk", "": "cpu"}
    with init_empty_weights():
        empty = TinyLM()
    load_checkpoint_in_model(empty, ckpt, device_map=dmap, offload_folder=tmp_path / "off")
    assert empty.blocks[3].up.weight.is_meta and not empty.blocks[0].up.weight.is_meta
    dispatched = dispatch_model(empty, dmap, offload_dir=tmp_path / "off")
    assert torch.equal(dispatched(IDS), want)

    torch.manual_seed(0)
    loaded = TinyLM().eval()  # a model already in memory, offloaded to disk by dispatch_model itself
    dispatched = dispatch_model(loaded, dmap, offload_dir=tmp_path / "off2")
    assert loaded.blocks[3].up.weight.is_meta and (tmp_path / "off2" / "blocks.3.up.weight.safetensors").is_file()
    assert torch.equal(dispatched(IDS), want)


def test_offloaded_weights_are_released_when_a_forward_raises_and_extra_tensors_warn(tmp_path: Path) -> None:
    model, ckpt = _reference(tmp_path)
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    save_file({**state, "extra.weight": torch.zeros(2)}, os.fspath(tmp_path / "extra.safetensors"))
    with init_empty_weights():
        empty = TinyLM()
    with pytest.warns(
        UserWarning, match="1 tensor\\(s\\) the model does not have were not loaded, first: extra.weight"
    ):
        loaded = load_checkpoint_and_dispatch(
            empty, tmp_path / "extra.safetensors", device_map={"": "disk"}, offload_folder=tmp_path / "off"
        )
    with pytest.raises(IndexError):
        loaded(torch.tensor([[99]]))  # out of the embedding's range: raises inside the offloaded embedding
    assert all(p.is_meta for p in loaded.parameters()), "the hook put the meta tensors back"
    assert torch.equal(loaded(IDS), model(IDS))
    with init_empty_weights():
        empty = TinyLM()
    with pytest.raises(ValueError, match="1 checkpoint tensor\\(s\\) the model does not have, first: extra.weight"):
        load_checkpoint_and_dispatch(empty, tmp_path / "extra.safetensors", device_map={"": "cpu"}, strict=True)


# ---- checkpoints written by others -----------------------------------------------------------------------------------


def test_kernel_save_model_output_loads_sharded_with_tied_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    kernel = accel.Kernel()
    model = kernel.prepare(TinyLM()).eval()
    kernel.save_model(model, tmp_path / "saved", max_shard_size="20KB")
    index = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["accel.aliases"] == {"head.weight": "embed.weight"}
    want = model(IDS)
    with init_empty_weights():
        empty = TinyLM()
    loaded = load_checkpoint_and_dispatch(
        empty,
        tmp_path / "saved",
        device_map="auto",
        max_memory={"cpu": 60_000},
        no_split_module_classes=["Block"],
        offload_folder=tmp_path / "off",
    )
    assert torch.equal(loaded(IDS), want)
    with init_empty_weights():
        empty = TinyLM()
    resident = load_checkpoint_and_dispatch(empty, tmp_path / "saved", device_map={"": "cpu"})
    assert resident.head.weight is resident.embed.weight  # loaded once, tied again
    assert torch.equal(resident(IDS), want)


@pytest.mark.smoke
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_save_pretrained_shards_load_with_a_device_map(tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
        cls, block = transformers.GPT2LMHeadModel, "GPT2Block"
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=4,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=32,
        )
        cls, block = transformers.LlamaForCausalLM, "LlamaDecoderLayer"
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        want = model(ids).logits
    with init_empty_weights():
        empty = cls(config).eval()  # no dropout
    budget = {"cpu": sum(p.numel() * 4 for p in model.parameters()) // 2}
    loaded = load_checkpoint_and_dispatch(
        empty,
        tmp_path / "hf",
        device_map="auto",
        max_memory=budget,
        no_split_module_classes=[block],
        offload_folder=tmp_path / "off",
    )
    assert {"cpu", "disk"} <= set(loaded.hf_device_map.values())
    with torch.no_grad():
        got = loaded(ids).logits
    assert torch.equal(got, want)


# ---- errors a user can act on ----------------------------------------------------------------------------------------


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text and isinstance(exc.value, accel.UsageError)
    return text


def test_a_device_map_that_does_not_fit_says_by_how_much_and_which_module(tmp_path: Path) -> None:
    _, ckpt = _reference(tmp_path)
    with init_empty_weights():
        empty = TinyLM()
    with pytest.raises(ValueError) as exc:
        load_checkpoint_and_dispatch(
            empty,
            ckpt,
            device_map={"embed": "cpu", "blocks": "cpu", "head": "cpu", "": "cpu"},
            max_memory={"cpu": "20KB"},
        )
    text = _one_line(exc)
    assert "max_memory['cpu'] is 20.0 KB" in text and "over, from module 'blocks'" in text, text
    with pytest.raises(ValueError) as exc:
        infer_auto_device_map(empty, max_memory={"cpu": 10_000}, no_split_module_classes=["Block"])
    text = _one_line(exc)
    assert "blocks.0 (" in text and "does not fit in max_memory['cpu'] (10.0 KB)" in text and "over" in text, text


def test_a_checkpoint_that_does_not_match_lists_the_first_mismatches(tmp_path: Path) -> None:
    model, _ = _reference(tmp_path)
    state = {f"model.{k}": v for k, v in model.state_dict().items() if k != "head.weight"}
    save_file(state, os.fspath(tmp_path / "prefixed.safetensors"))
    with init_empty_weights():
        empty = TinyLM()
    with pytest.raises(ValueError) as exc:
        load_checkpoint_and_dispatch(empty, tmp_path / "prefixed.safetensors", device_map="auto")
    text = _one_line(exc)
    assert "does not match the model" in text and "missing from it, first: embed.weight" in text, text
    assert "the model does not have, first: model." in text, text

    small = {
        k: v[..., :4].contiguous() if k == "blocks.0.up.weight" else v
        for k, v in model.state_dict().items()
        if k != "head.weight"
    }
    save_file(small, os.fspath(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError) as exc:
        load_checkpoint_and_dispatch(empty, tmp_path / "shape.safetensors", device_map="auto")
    assert "blocks.0.up.weight (128, 4) vs model (128, 32)" in _one_line(exc)

    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as exc:
        load_checkpoint_and_dispatch(empty, tmp_path / "pytorch_model.bin", device_map="auto")
    assert "safetensors" in _one_line(exc)


def test_disk_offload_without_offload_folder_is_refused_before_loading(tmp_path: Path) -> None:
    _, ckpt = _reference(tmp_path)
    with init_empty_weights():
        empty = TinyLM()
    with pytest.raises(ValueError) as exc:
        load_checkpoint_and_dispatch(
            empty, ckpt, device_map="auto", max_memory={"cpu": 60_000}, no_split_module_classes=["Block"]
        )
    text = _one_line(exc)
    assert "on disk (from 'blocks" in text and "max_memory (cpu: 60.0 KB)" in text and "offload_folder" in text
    assert all(p.is_meta for p in empty.parameters()), "nothing was loaded"


# ---- a model larger than the budget, in a fresh process --------------------------------------------------------------


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~1.0 GB of fp32 weights (30 blocks of 33.6 MB) in 4 shards with an index, written once per module."""
    folder = tmp_path_factory.mktemp("big") / "ckpt"
    result = subprocess.run(
        [sys.executable, str(PROBE), "write", str(folder)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.mark.slow
def test_weights_larger_than_the_budget_stream_within_it(big_checkpoint: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(PROBE),
            "load",
            str(big_checkpoint),
            "--budget",
            str(BUDGET),
            "--offload",
            str(tmp_path / "off"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    total = sum(p.stat().st_size for p in big_checkpoint.glob("*.safetensors"))
    assert total > 3 * BUDGET
    assert report["equal"], report  # bit for bit the fully loaded model's output
    assert report["placed"].get("disk", 0) > report["placed"].get("cpu", 0) > 0, report
    used = report["peak"] - report["baseline"]
    print(
        f"peak RSS over baseline {used / 1e6:.0f} MB for {total / 1e6:.0f} MB of weights, budget "
        f"{BUDGET / 1e6:.0f} MB (+{MARGIN / 2**20:.0f} MiB margin)"
    )
    assert used <= BUDGET + MARGIN, report
