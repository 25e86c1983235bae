"""send_to_device: the placement every prepared dataloader applies to each batch (fast paths included)."""

from __future__ import annotations

from collections import namedtuple

import torch

from accel.data import send_to_device

CPU, META = torch.device("cpu"), torch.device("meta")
Pair = namedtuple("Pair", "x y")


def test_batches_already_on_the_device_keep_their_tensors_in_a_new_container() -> None:
    x, y = torch.randn(2, 3), torch.arange(2)
    as_list = [x, y]
    out = send_to_device(as_list, CPU)
    assert out == [x, y] and out is not as_list  # the caller may mutate the batch it gets
    assert out[0] is x and out[1] is y
    assert send_to_device((x, y), CPU) == (x, y)
    as_dict = {"x": x, "y": y}
    moved = send_to_device(as_dict, CPU)
    assert moved is not as_dict and moved["x"] is x and moved["y"] is y


def test_every_tensor_of_a_nested_batch_is_moved() -> None:
    batch = {"pair": Pair(torch.ones(2), [torch.zeros(1), "label"]), "ids": (torch.arange(3), 7), "t": torch.ones(1)}
    out = send_to_device(batch, META)
    assert isinstance(out["pair"], Pair)
    assert out["pair"].x.device == META and out["pair"].y[0].device == META and out["pair"].y[1] == "label"
    assert out["ids"][0].device == META and out["ids"][1] == 7 and out["t"].device == META
    assert batch["t"].device == CPU  # the input is not changed


def test_a_list_with_one_tensor_elsewhere_is_moved_whole() -> None:
    here, there = torch.ones(1), torch.ones(1, device=META)
    out = send_to_device([there, here], META)  # the first is there already, the second is not
    assert out[0] is there and out[1].device == META
    out = send_to_device({"a": here, "b": there}, META)
    assert out["a"].device == META and out["b"] is there
