"""accel-plugin-tensorboard against the real thing: event files written by torch.utils.tensorboard, read back with
TensorBoard's EventAccumulator (scalars, text, images, hparams)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from accel.testing import make_kernel
from accel.testing.conformance import TrackerConformance


def accumulator(logdir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def hparams(acc: Any) -> dict[str, str]:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    data = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    out = {}
    for key, value in data.items():
        kind = value.WhichOneof("kind")
        out[key] = f"{value.number_value:g}" if kind == "number_value" else str(getattr(value, kind))
    return out


@pytest.mark.smoke
class TestTensorBoardConformance(TrackerConformance):
    name = "tensorboard"
    backend_modules = ("tensorboard", "torch.utils.tensorboard")

    def read_series(self, tmp_path: Path, project: str) -> dict[str, list[tuple[int, float]]]:
        acc = accumulator(tmp_path / "project" / project)
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    def read_config(self, tmp_path: Path, project: str) -> dict[str, str]:
        return hparams(accumulator(tmp_path / "project" / project))

    def count_runs(self, tmp_path: Path, project: str) -> int:
        return len(list((tmp_path / "project" / project).glob("events.out.tfevents.*")))


@pytest.fixture
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    kernel = make_kernel(["tensorboard"], log_with="tensorboard", project_dir=tmp_path / "project")
    yield kernel
    kernel.end_training()


@pytest.mark.smoke
def test_text_dicts_tensors_and_images_read_back(kernel: Any, tmp_path: Path) -> None:
    import torch

    kernel.init_trackers("media", config={"model": {"layers": [64, 32]}, "seed": None})
    kernel.log({"loss": torch.tensor(0.25), "note": "hello", "lr": {"group0": 0.1, "group1": 0.01}}, step=2)
    image = np.zeros((8, 6, 3), dtype=np.uint8)
    image[:, :3] = 255
    kernel.log_images({"sample": image, "grey": torch.rand(8, 6), "batch": [image, image]}, step=2)
    writer = kernel.get_tracker("tensorboard", unwrap=True)
    assert writer.get_logdir() == str(tmp_path / "project" / "media")
    kernel.end_training()

    acc = accumulator(tmp_path / "project" / "media")
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(2, 0.25)]
    assert "note/text_summary" in acc.Tags()["tensors"]
    assert set(acc.Tags()["images"]) == {"sample", "grey", "batch"}  # a list is written as one grid image
    sample = acc.Images("sample")[0]
    assert (sample.step, sample.width, sample.height) == (2, 6, 8)
    assert hparams(acc) == {"model/layers": "[64, 32]", "seed": "None"}
    # add_scalars writes one sub-directory per key
    group = accumulator(tmp_path / "project" / "media" / "lr_group1")
    assert [(e.step, round(e.value, 6)) for e in group.Scalars("lr")] == [(2, 0.01)]


def test_logging_dir_from_init_kwargs(kernel: Any, tmp_path: Path) -> None:
    kernel.init_trackers(
        "elsewhere", init_kwargs={"tensorboard": {"logging_dir": str(tmp_path / "tb"), "flush_secs": 5}}
    )
    kernel.log({"loss": 1.0}, step=0)
    kernel.end_training()
    assert [e.value for e in accumulator(tmp_path / "tb" / "elsewhere").Scalars("loss")] == [1.0]
