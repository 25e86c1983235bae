"""Fault injection for big-model loading: hostile or broken checkpoint files, indexes, device maps,
memory budgets and offload folders each give one line of one error type naming the file (or value) and the reason:
:class:`accel_bigmodel.loading.CheckpointLoadError` (an ``accel.CheckpointError``) for files,
:class:`accel.utils.DeviceMapError` (an ``accel.UsageError``) for maps and budgets. Files are made in tmp_path."""

from __future__ import annotations

import json
import os
import pickle
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from big_model_defs import TinyLM
from safetensors.torch import save_file

import accel
from accel.utils import (
    dispatch_model,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)
from accel_bigmodel.loading import CheckpointLoadError, CheckpointMismatch
from accel_bigmodel.modeling import DeviceMapError

IDS = torch.tensor([[1, 2, 3]])


def _state(**kwargs: object) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyLM(**kwargs)  # type: ignore[arg-type]
    return {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"}


def _empty() -> TinyLM:
    with init_empty_weights():
        return TinyLM()


def _one_line(exc: pytest.ExceptionInfo[BaseException], kind: type[Exception]) -> str:
    text = str(exc.value)
    assert isinstance(exc.value, kind) and isinstance(exc.value, accel.UsageError), type(exc.value)
    assert "\n" not in text, text
    return text


def _write_good(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    save_file(_state(), os.fspath(path))
    return path


# ---- broken safetensors files ----------------------------------------------------------------------------------------


def _header_2_40(raw: bytes) -> bytes:
    return struct.pack("<Q", 2**40) + raw[8:]


def _offsets_past_the_end(raw: bytes) -> bytes:
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"] = [0, 10**12]
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + raw[8 + n :]


FILES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "header of 2**40 bytes": (_header_2_40, "header too large"),
    "offsets past the end": (_offsets_past_the_end, "invalid shape, data type, or offset"),
    "truncated shard": (lambda raw: raw[: len(raw) // 2], "incomplete metadata"),
    "pickle named .safetensors": (lambda raw: pickle.dumps({"embed.weight": [1.0, 2.0]}), "header too large"),
    "empty file": (lambda raw: b"", "header too small"),
}


@pytest.mark.parametrize("case", list(FILES))
def test_a_broken_safetensors_file_is_one_line_naming_it(tmp_path: Path, case: str) -> None:
    path = _write_good(tmp_path / "ckpt")
    forge, reason = FILES[case]
    path.write_bytes(forge(path.read_bytes()))
    with pytest.raises(CheckpointLoadError) as exc:
        load_checkpoint_and_dispatch(_empty(), path.parent, device_map="auto")
    text = _one_line(exc, CheckpointLoadError)
    assert f"cannot read the safetensors file {path}: " in text and reason in text, text


def test_a_shard_damaged_after_loading_is_one_line_at_the_forward(tmp_path: Path) -> None:
    # disk offload reads the checkpoint's own file at each forward: a file replaced meanwhile names itself
    path = _write_good(tmp_path / "ckpt")
    model = load_checkpoint_and_dispatch(_empty(), path.parent, device_map={"": "disk"}, offload_folder=tmp_path / "o")
    path.write_bytes(b"")
    with pytest.raises(CheckpointLoadError) as exc:
        model(IDS)
    text = _one_line(exc, CheckpointLoadError)
    assert f"cannot read the safetensors file {path}: " in text and "header too small" in text, text


# ---- sharded indexes ------------------------------------------------------------------------------------------------


def _sharded(folder: Path) -> Path:
    folder.mkdir(parents=True)
    state = _state()
    names = sorted(state)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({k: state[k] for k in part}, os.fspath(folder / f"model-0000{i + 1}-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if k in names[:half] else 2}-of-00002.safetensors" for k in names}
    index = folder / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"metadata": {"accel.aliases": {"head.weight": "embed.weight"}}, "weight_map": weight_map})
    )
    return index


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("weight_map is a list", '"weight_map" must map tensor names to file or tensor names'),
        ("weight_map has integer values", '"weight_map" must map tensor names to file or tensor names'),
        ("aliases are a list", '"metadata"."accel.aliases" must map tensor names to file or tensor names'),
        ("not json", "cannot read the index"),
    ],
)
def test_a_damaged_index_is_one_line(tmp_path: Path, case: str, expected: str) -> None:
    index = _sharded(tmp_path / "ckpt")
    data = json.loads(index.read_text())
    if case == "weight_map is a list":
        data["weight_map"] = list(data["weight_map"].items())
    elif case == "weight_map has integer values":
        data["weight_map"] = {k: 1 for k in data["weight_map"]}
    elif case == "aliases are a list":
        data["metadata"]["accel.aliases"] = [["head.weight", "embed.weight"]]
    index.write_text(json.dumps(data) if case != "not json" else "{" * 50)
    with pytest.raises(CheckpointLoadError) as exc:
        load_checkpoint_and_dispatch(_empty(), index.parent)
    text = _one_line(exc, CheckpointLoadError)
    assert str(index) in text and expected in text, text


def test_a_shard_linked_out_of_its_folder_is_refused_and_the_hugging_face_cache_layout_loads(tmp_path: Path) -> None:
    index = _sharded(tmp_path / "ckpt")
    shard = index.parent / "model-00001-of-00002.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(CheckpointLoadError) as exc:
        load_checkpoint_and_dispatch(_empty(), index.parent)
    text = _one_line(exc, CheckpointLoadError)
    assert f"the shard {shard} is a link to {outside}, outside the checkpoint's folder: refused" in text, text
    # Hugging Face's cache: snapshots/<revision>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    hf_index = _sharded(repo / "snapshots" / "abc123")
    for i, file in enumerate(sorted(hf_index.parent.glob("*.safetensors"))):
        blob = repo / "blobs" / f"hash{i}"
        file.rename(blob)
        file.symlink_to(Path("..") / ".." / "blobs" / blob.name)
    model = load_checkpoint_and_dispatch(_empty(), hf_index.parent)
    assert model(IDS).shape == (1, 3, 50)


def test_a_tensor_the_model_does_not_have_is_named_even_when_the_index_does_not_list_it(tmp_path: Path) -> None:
    index = _sharded(tmp_path / "ckpt")
    shard = index.parent / "model-00002-of-00002.safetensors"
    from safetensors.torch import load_file

    save_file({**load_file(os.fspath(shard)), "stray.weight": torch.zeros(2)}, os.fspath(shard))
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) the model does not have were not loaded, first: stray.weight"):
        model = load_checkpoint_and_dispatch(_empty(), index.parent)
    assert model(IDS).shape == (1, 3, 50)
    with pytest.raises(CheckpointMismatch) as exc:  # strict, as Accelerate's strict=True
        load_checkpoint_in_model(_empty(), index.parent, strict=True)
    assert "1 checkpoint tensor(s) the model does not have, first: stray.weight" in _one_line(exc, CheckpointMismatch)


# ---- dtypes ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stored", [torch.int64, torch.bool])
def test_integer_or_bool_values_into_a_float_model_are_refused_unless_dtype_asks(
    tmp_path: Path, stored: torch.dtype
) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    state = {k: (v * 3).to(stored) if k.endswith("up.weight") else v for k, v in _state().items()}
    save_file(state, os.fspath(folder / "model.safetensors"))
    with pytest.raises(CheckpointMismatch) as exc:
        load_checkpoint_and_dispatch(_empty(), folder)
    text = _one_line(exc, CheckpointMismatch)
    name = "I64" if stored == torch.int64 else "BOOL"
    assert (
        f"stores 6 tensor(s) as another kind of number than the model, first: blocks.0.up.weight ({name} into float32)"
        in text
    ), text
    assert "pass dtype=torch.float32" in text
    model = load_checkpoint_and_dispatch(_empty(), folder, dtype=torch.float32)  # asked: converted
    assert torch.equal(model.blocks[0].up.weight, state["blocks.0.up.weight"].float())
    fresh = _empty()
    with pytest.raises(CheckpointMismatch):
        load_checkpoint_in_model(fresh, folder)


# ---- device maps, budgets, offload folders ---------------------------------------------------------------------------


def _absent_accelerator() -> int:
    return torch.accelerator.device_count() + 5 if torch.accelerator.is_available() else 5


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"device_map": "auto", "max_memory": "absent"}, "names accelerator {absent}, but this machine has"),
        ({"device_map": "auto", "max_memory": ["1GB"]}, "max_memory must be a dict {device: size}"),
        ({"device_map": "auto", "max_memory": "10GB"}, "max_memory must be a dict {device: size}"),
        (
            {"device_map": "auto", "max_memory": {"tpu9": "1GB", "cpu": "1GB"}},
            "max_memory ('tpu9'): cannot read the device 'tpu9': use ",
        ),
        (
            {"device_map": {"blocks": "cpu", "embed": "cpu", "haed": "cpu", "": "cpu"}},
            "the device map names 'haed' (did you mean 'head'?), which is not a module or tensor of the model",
        ),
        ({"device_map": {"": "absent"}}, "the device map names accelerator {absent}, but this machine has"),
        ({"device_map": {"": "disk"}, "offload_folder": "a file"}, "is a file, not a folder"),
    ],
)
def test_a_device_map_budget_or_offload_folder_that_cannot_work_is_one_line(
    tmp_path: Path, kwargs: dict[str, object], expected: str
) -> None:
    path = _write_good(tmp_path / "ckpt")
    absent = _absent_accelerator()
    if kwargs.get("max_memory") == "absent":
        kwargs["max_memory"] = {absent: "1GB", "cpu": "1GB"}
    if kwargs.get("device_map") == {"": "absent"}:
        kwargs["device_map"] = {"": absent}
    if kwargs.get("offload_folder") == "a file":
        (tmp_path / "a_file").write_text("x")
        kwargs["offload_folder"] = tmp_path / "a_file"
    with pytest.raises(DeviceMapError) as exc:
        load_checkpoint_and_dispatch(_empty(), path.parent, **kwargs)  # type: ignore[arg-type]
    text = _one_line(exc, DeviceMapError)
    assert expected.replace("{absent}", str(absent)) in text, text


@pytest.mark.parametrize("field", ["dtype", "shape"])
def test_a_forged_offload_index_is_refused(tmp_path: Path, field: str) -> None:
    path = _write_good(tmp_path / "ckpt")
    model, offload = _empty(), tmp_path / "offload"
    load_checkpoint_in_model(model, path.parent, device_map={"": "disk"}, offload_folder=offload)
    index = offload / "index.json"
    data = json.loads(index.read_text())
    first = next(iter(data))
    if field == "dtype":
        data[first]["dtype"] = "load"  # torch.load, not a dtype
    else:
        data[first] = ["not", "a", "mapping"]
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointLoadError) as exc:
        dispatch_model(model, {"": "disk"}, offload_dir=offload)
    text = _one_line(exc, CheckpointLoadError)
    assert f"the offload index {index} is damaged at {first!r}" in text, text


# ---- a long load speaks ---------------------------------------------------------------------------------------------


def test_a_load_that_takes_long_says_how_far_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from accel_bigmodel import loading

    path = _write_good(tmp_path / "ckpt")
    load_checkpoint_and_dispatch(_empty(), path.parent)
    assert "accel: load" not in capsys.readouterr().err  # a quick load says nothing
    monkeypatch.setattr(loading, "PROGRESS_AFTER_S", 0.0)  # every load counts as long
    monkeypatch.setattr(loading, "PROGRESS_EVERY_S", 0.0)
    load_checkpoint_and_dispatch(_empty(), path.parent)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"accel: loading {path.parent}: ") and " read (" in lines[0], lines
    assert lines[-1].startswith(f"accel: loaded {path.parent} in "), lines
