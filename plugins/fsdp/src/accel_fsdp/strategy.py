"""The FSDP2 strategy component: a 1-D device mesh over every process, ``fully_shard`` with the ``fsdp_*`` options,
and everything else from the plugin API's sharded-training toolkit (:mod:`accel.spi.sharded`). torch is imported
inside methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.spi import KernelView, LaunchPlan, hookimpl, launch_with_torchrun
from accel.spi.sharded import ShardConfig, ShardedStrategy, shard_model
from accel_fsdp import reshard_after_forward

if TYPE_CHECKING:
    from torch import nn


class FSDPStrategy(ShardedStrategy):
    """Answers for a fully sharded run (FSDP2). Activated only when selected (``--plugin fsdp``)."""

    @hookimpl
    def accel_launch(self, plan: LaunchPlan) -> int:
        return launch_with_torchrun(plan, "fsdp")

    @hookimpl
    def accel_setup(self, kernel: KernelView) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.start_process_group()
        self.mesh = init_device_mesh(self.device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))

    def shard_config(self) -> ShardConfig:
        s = self.settings
        return ShardConfig.from_settings(
            s, "fsdp_", reshard_after_forward=reshard_after_forward(s), loading_option="fsdp_cpu_ram_efficient_loading"
        )

    def shard(self, kernel: KernelView, model: nn.Module) -> None:
        efficient = bool(self.settings["fsdp_cpu_ram_efficient_loading"]) and kernel.num_processes > 1
        shard_model(model, self.shard_config(), self.mesh, self.device, kernel if efficient else None)

    def full_state_dict(self) -> bool:
        return bool(self.settings["fsdp_state_dict_type"] == "FULL_STATE_DICT")
