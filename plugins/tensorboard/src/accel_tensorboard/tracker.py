"""The TensorBoard tracker component. torch and tensorboard are imported inside the methods."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.spi import Tracker, as_scalar, flatten, hookimpl

if TYPE_CHECKING:
    from accel.spi import KernelView


def _image(value: Any) -> Any:
    """An image as a numpy array (PIL images and tensors included), channels last."""
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


class TensorBoardTracker(Tracker):
    """Writes ``<logging_dir>/<project_name>/events.out.tfevents.*`` with ``torch.utils.tensorboard``.

    ``logging_dir``: ``init_kwargs["tensorboard"]["logging_dir"]``, else the Kernel's ``logging_dir``
    (``ProjectConfiguration(logging_dir=...)``, else ``project_dir``, as Accelerate), else ``./runs``. Other ``init_kwargs["tensorboard"]`` entries go to ``SummaryWriter`` (``flush_secs``, ...).
    The config is written as TensorBoard hparams in the same directory."""

    provides = frozenset({"tracker:tensorboard"})

    def __init__(self) -> None:
        self.run = None
        self.logging_dir: str | None = None
        self._skipped: set[str] = set()

    @hookimpl
    def accel_init_trackers(
        self, kernel: KernelView, project_name: str, config: Mapping[str, Any], init_kwargs: Mapping[str, Any]
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        kwargs = dict(init_kwargs.get("tensorboard", {}))
        base = kwargs.pop("logging_dir", None) or kernel.logging_dir or "runs"
        self.logging_dir = os.path.join(os.fspath(base), project_name)
        self.run = SummaryWriter(self.logging_dir, **kwargs)
        if config:
            from torch.utils.tensorboard.summary import hparams

            # Same directory as the scalars (SummaryWriter.add_hparams would open a sub-directory per call).
            for summary in hparams(flatten(config), metric_dict={}):
                self.run.file_writer.add_summary(summary)
        self.run.flush()

    @hookimpl
    def accel_log(
        self, kernel: KernelView, values: Mapping[str, Any], step: int | None, log_kwargs: Mapping[str, Any]
    ) -> None:
        writer = self.run
        kwargs = dict(log_kwargs.get("tensorboard", {}))
        for key, value in values.items():
            number = as_scalar(value)
            if number is not None:
                writer.add_scalar(key, number, global_step=step, **kwargs)
            elif isinstance(value, str):
                writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping) and all(as_scalar(v) is not None for v in value.values()):
                writer.add_scalars(key, {k: as_scalar(v) for k, v in value.items()}, global_step=step, **kwargs)
            elif key not in self._skipped:
                self._skipped.add(key)
                warnings.warn(
                    f"tensorboard: cannot log {key!r} of type {type(value).__name__}; skipped",
                    RuntimeWarning,
                    stacklevel=2,
                )
        writer.flush()

    @hookimpl
    def accel_log_images(
        self, kernel: KernelView, values: Mapping[str, Any], step: int | None, log_kwargs: Mapping[str, Any]
    ) -> None:
        import numpy as np

        writer = self.run
        kwargs = dict(log_kwargs.get("tensorboard", {}))
        for key, value in values.items():
            if isinstance(value, (list, tuple)):
                batch = np.stack([_image(v) for v in value])
                formats = "NHW" if batch.ndim == 3 else "NHWC"
                writer.add_images(key, batch, global_step=step, dataformats=formats, **kwargs)
            else:
                image = _image(value)
                writer.add_image(key, image, global_step=step, dataformats="HW" if image.ndim == 2 else "HWC", **kwargs)
        writer.flush()

    @hookimpl
    def accel_end_training(self, kernel: KernelView) -> None:
        if self.run is not None:
            self.run.close()
            self.run = None
