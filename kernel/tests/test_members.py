"""How a Kernel offers its parts' members (accel/members.py, accel/parts.py, accel.builtin.BUILTIN_PARTS)."""

from __future__ import annotations

import importlib
import inspect
import pickle
from typing import Any

import pytest
import torch

import accel
from accel import Kernel, active, parts
from accel.builtin import BUILTIN_PARTS
from accel.members import Attribute, Forward


def _members(cls: type) -> dict[str, Forward[Any, Any, Any] | Attribute[Any]]:
    return {name: value for name, value in vars(cls).items() if isinstance(value, (Forward, Attribute))}


def test_every_forwarded_member_keeps_the_parts_docstring_and_signature() -> None:
    forwarded = {n: m for n, m in _members(Kernel).items() if isinstance(m, Forward)}
    assert {"gather", "save_state", "log", "unwrap_model", "skip_first_batches"} <= set(forwarded)
    for name, member in forwarded.items():
        function = getattr(Kernel, name)  # a function of a Kernel, as a method's is, named as the part's method
        assert function is member.function and function.__wrapped__ is member.method, name
        assert function.__name__ == member.method.__name__ and function.__doc__ == member.method.__doc__, name
        assert member.__doc__ == member.method.__doc__, name
        if name != "_is_prepared":
            assert (member.method.__doc__ or "").strip(), f"Kernel.{name} has no docstring"


def test_a_member_reads_the_part_of_this_kernel() -> None:
    k = Kernel(cpu=True)
    try:
        assert k.gather.__self__ is k._ops  # a bound method of the part
        assert k.save_state.__self__ is k._checkpoints
        assert k.split_batches is False and k.save_iteration == 0 and k.trackers == []
        k.dataloader_config = accel.DataLoaderConfiguration(even_batches=False)  # assigned through to the part
        assert k.even_batches is False and k.dataloader_config.even_batches is False
        # as a property's: what a subclass's property calls
        Kernel.dataloader_config.fset(k, accel.DataLoaderConfiguration(even_batches=True))
        assert Kernel.dataloader_config.fget(k).even_batches is True and k.even_batches is True
    finally:
        k.end_training()


def test_the_class_member_is_a_function_of_a_kernel_that_a_wrapper_can_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``original = Kernel.gather`` then ``original(kernel, t)``: what a wrapper patched onto the class does."""
    original = Kernel.gather
    calls: list[int] = []

    def counted(self: Kernel, tensor: Any) -> Any:
        calls.append(1)
        return original(self, tensor)

    monkeypatch.setattr(Kernel, "gather", counted)
    k = Kernel(cpu=True)
    try:
        assert torch.equal(k.gather_for_metrics(torch.ones(3)), torch.ones(3))  # the part calls kernel.gather
        assert calls == [1]
    finally:
        k.end_training()


def test_a_fact_of_the_run_cannot_be_assigned() -> None:
    k = Kernel(cpu=True)
    try:
        for name in ("num_processes", "process_index", "is_main_process", "data_parallel_size", "save_iteration"):
            with pytest.raises(AttributeError, match=f"kernel.{name} cannot be set"):
                setattr(k, name, 3)
        assert k.num_processes == 1
    finally:
        k.end_training()


def test_a_subclass_override_is_called_and_super_reaches_the_part() -> None:
    calls: list[str] = []

    class Mine(Kernel):
        def gather(self, tensor: Any) -> Any:
            calls.append("mine")
            return super().gather(tensor) * 2

    k = Mine(cpu=True)
    try:
        assert torch.equal(k.gather(torch.ones(2)), torch.full((2,), 2.0))
        # the part's own calls to an overridable member go through the Kernel, so they reach the override
        assert torch.equal(k.gather_for_metrics(torch.ones(2)), torch.full((2,), 2.0))
        assert calls == ["mine", "mine"]
    finally:
        k.end_training()


def test_a_detached_kernel_names_the_member_it_cannot_answer() -> None:
    k = Kernel(cpu=True)
    try:
        assert pickle.loads(pickle.dumps(k)) is k  # the same process: this Kernel again
        _, (cls, pid, ident, facts) = k.__reduce__()
    finally:
        k.end_training()
    copy = active.unpickle_kernel(cls, pid + 1, ident, facts)  # what another process (another pid) gets
    assert copy.num_processes == 1 and copy.device == k.device
    with pytest.raises(AttributeError, match=r"kernel.gather: this Kernel was unpickled in another process"):
        copy.gather(torch.ones(1))
    with pytest.raises(AttributeError, match=r"kernel.save_state: this Kernel was unpickled"):
        copy.save_state()


@pytest.mark.parametrize(("attribute", "where"), BUILTIN_PARTS)
def test_each_builtin_part_has_every_member_of_its_protocol(attribute: str, where: str) -> None:
    module, name = where.split(":")
    cls = getattr(importlib.import_module(module), name)
    protocol = {"_tracking": parts.TrackingPart, "_checkpoints": parts.CheckpointPart}[attribute]
    declared = [n for n in vars(protocol) if not n.startswith("_")]
    assert declared
    for member in declared:
        spec, impl = getattr(protocol, member), getattr(cls, member, None)
        assert impl is not None, f"{where} lacks {member}"
        if inspect.isfunction(spec):
            assert inspect.signature(impl) == inspect.signature(spec), f"{where}.{member}"
        else:
            assert isinstance(impl, property) and (impl.fset is None) == (spec.fset is None), f"{where}.{member}"
    # and the Kernel offers each of them, from that part
    for member in declared:
        offered = _members(Kernel)[member]
        assert offered.part == attribute, member


def test_the_kernel_loop_module_holds_no_feature() -> None:
    """The Kernel makes the built-in parts by name: importing accel.kernel imports no checkpoint code."""
    import subprocess
    import sys

    code = "import accel.kernel, sys; print(sorted(m for m in sys.modules if m.startswith('accel.checkpoint')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
