"""The Weights & Biases tracker component. wandb is imported inside the methods."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.spi import Tracker, hookimpl

if TYPE_CHECKING:
    from accel.spi import KernelView


def _image(value: Any) -> Any:
    if hasattr(value, "detach"):  # a tensor, channels last as accel's convention says
        value = value.detach().cpu().numpy()
    return value


class WandbTracker(Tracker):
    """``wandb.init(project=project_name, config=config, dir=project_dir, **init_kwargs["wandb"])``.

    Online, offline (``WANDB_MODE=offline``) and every other wandb setting work as wandb documents them; the run
    directory goes under the Kernel's ``project_dir`` when one is set (``dir=`` in ``init_kwargs`` wins)."""

    provides = frozenset({"tracker:wandb"})

    def __init__(self) -> None:
        self.run = None

    @hookimpl
    def accel_init_trackers(
        self, kernel: KernelView, project_name: str, config: Mapping[str, Any], init_kwargs: Mapping[str, Any]
    ) -> None:
        import wandb

        kwargs = dict(init_kwargs.get("wandb", {}))
        kwargs.setdefault("project", project_name)
        if kernel.project_dir and "dir" not in kwargs:
            kwargs["dir"] = kernel.project_dir
        if kwargs.get("dir"):
            os.makedirs(kwargs["dir"], exist_ok=True)
        self.run = wandb.init(**kwargs)
        if config:
            self.run.config.update(dict(config), allow_val_change=True)

    @hookimpl
    def accel_log(
        self, kernel: KernelView, values: Mapping[str, Any], step: int | None, log_kwargs: Mapping[str, Any]
    ) -> None:
        self.run.log(dict(values), step=step, **log_kwargs.get("wandb", {}))

    @hookimpl
    def accel_log_images(
        self, kernel: KernelView, values: Mapping[str, Any], step: int | None, log_kwargs: Mapping[str, Any]
    ) -> None:
        import wandb

        images = {
            key: [wandb.Image(_image(v)) for v in value]
            if isinstance(value, (list, tuple))
            else wandb.Image(_image(value))
            for key, value in values.items()
        }
        self.run.log(images, step=step, **log_kwargs.get("wandb", {}))

    @hookimpl
    def accel_log_table(
        self,
        kernel: KernelView,
        table_name: str,
        columns: list[str],
        data: list[list[Any]],
        step: int | None,
        log_kwargs: Mapping[str, Any],
    ) -> None:
        import wandb

        header: list[str | int] = list(columns)
        self.run.log({table_name: wandb.Table(columns=header, data=data)}, step=step, **log_kwargs.get("wandb", {}))

    @hookimpl
    def accel_end_training(self, kernel: KernelView) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
