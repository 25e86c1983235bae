"""accel.nested.map_tensors, the one walk over nested tensor structures, and the places that use it:
a model prepared under bf16 returns fp32 tensors inside named tuples too (AutocastModule's promise)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from accel import Kernel
from accel.data import empty_like_batch, send_to_device
from accel.nested import map_tensors


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    for var in ("ACCEL_CONFIG", "ACCEL_MIXED_PRECISION", "MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


class Output(NamedTuple):
    logits: torch.Tensor
    extras: dict[str, Any]


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> Output:
        out = self.fc(x)
        return Output(out, {"hidden": [out * 2], "steps": 1, "ids": torch.arange(3)})


def test_bf16_model_returns_fp32_inside_a_namedtuple() -> None:
    kernel = Kernel(mixed_precision="bf16")  # accel-plugin-amp autocasts the forward
    model = kernel.prepare(TupleNet())
    out = model(torch.randn(2, 4))
    with kernel.autocast():
        assert kernel.unwrap_model(model)(torch.randn(2, 4)).logits.dtype == torch.bfloat16  # what autocast gives
    assert type(out) is Output
    assert out.logits.dtype == torch.float32 and out.extras["hidden"][0].dtype == torch.float32
    assert out.extras["steps"] == 1 and out.extras["ids"].dtype == torch.int64  # non-floats untouched


def test_map_tensors_keeps_every_container_type() -> None:
    Point = collections.namedtuple("Point", "x y")
    data = collections.OrderedDict(a=[torch.ones(2), (torch.zeros(1), "s")], b=Point(torch.ones(1), 3))
    out = map_tensors(lambda t: t + 1, data)
    assert type(out) is collections.OrderedDict and type(out["b"]) is Point and type(out["a"][1]) is tuple
    assert out["a"][0].tolist() == [2.0, 2.0] and out["a"][1][1] == "s" and out["b"].y == 3
    with pytest.raises(TypeError, match="expected tensors .* got str"):
        map_tensors(lambda t: t, {"a": "text"}, strict=True)


def test_send_to_device_and_empty_batches_walk_namedtuples() -> None:
    batch = {"pair": Output(torch.ones(3, 2), {"mask": torch.ones(3)}), "n": 3}
    moved = send_to_device(batch, torch.device("cpu"))
    assert type(moved["pair"]) is Output and torch.equal(moved["pair"].extras["mask"], torch.ones(3))
    empty = empty_like_batch(batch)
    assert empty["pair"].logits.shape == (0, 2) and empty["pair"].extras["mask"].shape == (0,) and empty["n"] == 3


def test_the_plugins_walks_are_the_same_helper() -> None:
    """accel-plugin-deepspeed's input cast and accel-plugin-xla's copy to the CPU walk named tuples too, and the
    xla copy keeps tied tensors tied."""
    from accel_deepspeed.model import cast_floats
    from accel_xla.strategy import to_cpu

    Pair = collections.namedtuple("Pair", "x ids")
    cast = cast_floats({"in": Pair(torch.ones(2), torch.arange(2))}, torch.bfloat16)
    assert type(cast["in"]) is Pair and cast["in"].x.dtype == torch.bfloat16 and cast["in"].ids.dtype == torch.int64
    weight = torch.ones(2)
    copied = to_cpu({"w": weight, "tied": weight, "pair": Pair(weight, 1)})
    assert copied["w"] is copied["tied"] is copied["pair"].x and copied["pair"].ids == 1
