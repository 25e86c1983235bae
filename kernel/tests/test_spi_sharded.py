"""accel.spi.sharded, the local parts of the sharded-training toolkit plugins build on (the collective ones run on
real meshes in plugins/fsdp/tests and plugins/parallel/tests): importing it does not import torch, the options it
declares under a plugin's prefix with Accelerate's defaults, ``ShardConfig`` from resolved settings, which
submodules each wrap policy makes shard units, clipping by the global norm of plain gradients as torch does, and
how a checkpoint item's format is told from its files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accel.contract import DCP_FORMAT
from accel.errors import UsageError
from accel.options import Options, Settings, resolve
from accel.spi import sharded
from accel.spi.sharded import ShardConfig, clip_grad_norm, declare_shard_options, detect_record, wrap_units


def test_importing_it_does_not_import_torch() -> None:
    code = "import sys\nfrom accel.spi import sharded\nprint(sorted(m for m in ('torch',) if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out
    assert sorted(sharded.__all__) == sorted(set(sharded.__all__)) and all(hasattr(sharded, n) for n in sharded.__all__)


def settings(**values: Any) -> Settings:
    """The options a plugin with prefix ``mine_`` declares, resolved as the launcher does, plus mixed_precision."""
    options = Options()
    options.current_plugin = "mine"
    declare_shard_options(lambda name, **kw: options.add(name, config_key=f"mine_config.{name}", **kw), "mine_")
    options.add("mixed_precision", default="no")
    resolved, sources = resolve(options, kwargs=values, env={})
    return Settings(resolved, sources)


def test_the_options_are_declared_under_the_prefix_with_accelerates_defaults() -> None:
    config = ShardConfig.from_settings(settings(), "mine_")
    assert config == ShardConfig(prefix="mine_")
    assert (config.auto_wrap_policy, config.min_num_params, config.reshard_after_forward) == (
        "TRANSFORMER_BASED_WRAP",
        100_000_000,
        True,
    )
    assert config.param_dtype is None and not config.offload_params and not config.activation_checkpointing


def test_shard_config_takes_the_resolved_values_and_bf16() -> None:
    config = ShardConfig.from_settings(
        settings(
            mine_auto_wrap_policy="size_based_wrap",
            mine_transformer_layer_cls_to_wrap="Block,Head",
            mine_min_num_params="10",
            mine_offload_params="true",
            mixed_precision="bf16",
        ),
        "mine_",
        loading_option="mine_cpu_ram_efficient_loading",
    )
    assert config.auto_wrap_policy == "SIZE_BASED_WRAP" and config.layer_classes == ("Block", "Head")
    assert config.min_num_params == 10 and config.offload_params and config.param_dtype == torch.bfloat16
    assert config.loading_option == "mine_cpu_ram_efficient_loading"


def test_a_bad_option_value_names_the_prefixed_option() -> None:
    with pytest.raises(UsageError) as info:
        settings(mine_auto_wrap_policy="LAYER_WRAP")
    assert str(info.value).startswith("Kernel(mine_auto_wrap_policy=...) must be one of TRANSFORMER_BASED_WRAP, ")
    with pytest.raises(UsageError, match=r"^Kernel\(mine_min_num_params=\.\.\.\) must be at least 1, got 0$"):
        settings(mine_min_num_params=0)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 8)  # 800 parameters
        self.blocks = nn.ModuleList([Block(8) for _ in range(2)])  # 72 + 16 each
        self.head = nn.Linear(8, 100)  # 900


def test_wrap_units_follow_the_policy() -> None:
    net = Net()
    blocks = list(net.blocks)
    assert wrap_units(net, ShardConfig(auto_wrap_policy="NO_WRAP")) == []
    assert wrap_units(net, ShardConfig()) == blocks  # the model's _no_split_modules
    assert wrap_units(net, ShardConfig(layer_classes=("Linear",))) == [blocks[0].inner, blocks[1].inner, net.head]
    # by size, bottom-up: a unit claims its parameters, so a parent counts only what is left
    assert wrap_units(net, ShardConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=800)) == [
        net.embed,
        net.head,
    ]
    assert wrap_units(net, ShardConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=80)) == [
        net.embed,
        blocks[0],
        blocks[1],
        net.head,
    ]
    assert net not in wrap_units(net, ShardConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1))


def test_a_layer_class_the_model_lacks_is_one_line() -> None:
    with pytest.raises(UsageError) as info:
        wrap_units(Net(), ShardConfig(layer_classes=("Block", "DecoderLayer"), prefix="mine_"))
    assert str(info.value) == (
        "mine_transformer_layer_cls_to_wrap: no module of class DecoderLayer in Net (classes there: Block, "
        "Embedding, LayerNorm, Linear, ModuleList, Net)"
    )


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clipping_plain_gradients_is_torchs(norm_type: float) -> None:
    torch.manual_seed(0)
    ours, theirs = nn.Linear(6, 5), nn.Linear(6, 5)
    theirs.load_state_dict(ours.state_dict())
    ours(torch.randn(4, 6)).pow(2).sum().backward()
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert p.grad is not None
        q.grad = p.grad.clone()
    norm = clip_grad_norm(ours.parameters(), 0.5, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type)
    assert torch.equal(norm, expected)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-7)  # type: ignore[arg-type]
    assert float(clip_grad_norm([nn.Parameter(torch.ones(2))], 1.0)) == 0.0  # no gradient at all


def test_a_non_finite_norm_raises_only_when_asked() -> None:
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan"), 2.0])
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        clip_grad_norm([p], 1.0, error_if_nonfinite=True)
    assert not torch.isfinite(clip_grad_norm([p], 1.0))


def test_an_items_format_is_told_from_its_files(tmp_path: Path) -> None:
    assert detect_record(tmp_path, "model", "mine") is None
    (tmp_path / "model.safetensors").touch()
    (tmp_path / "optimizer.pt").touch()
    (tmp_path / "model_1").mkdir()
    (tmp_path / "model_1" / ".metadata").touch()
    full = detect_record(tmp_path, "model", "mine")
    assert full is not None and (full.format, full.files) == (sharded.FULL_MODEL_FORMAT, ("model.safetensors",))
    optim = detect_record(tmp_path, "optimizer", "mine")
    assert optim is not None and (optim.format, optim.files) == (sharded.FULL_OPTIM_FORMAT, ("optimizer.pt",))
    dcp = detect_record(tmp_path, "model_1", "mine")
    assert dcp is not None and (dcp.plugin, dcp.format, dcp.files) == ("mine", DCP_FORMAT, ("model_1",))
