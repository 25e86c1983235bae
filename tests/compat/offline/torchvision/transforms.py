"""The transforms of ``torchvision.transforms`` that diffusers' training scripts use, on PIL images and CHW tensors
(pure torch; bilinear resizing, torch's RNG for the random ones). Shared parts come from ``compat_offline``."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from compat_offline import Compose, Normalize, ToTensor, _to_tensor
from compat_offline import Resize as _Resize

__all__ = [
    "CenterCrop",
    "Compose",
    "ConvertImageDtype",
    "InterpolationMode",
    "Lambda",
    "Normalize",
    "PILToTensor",
    "RandomCrop",
    "RandomHorizontalFlip",
    "Resize",
    "ToTensor",
]


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


class Resize(_Resize):
    def __init__(self, size: int | tuple[int, int], interpolation: InterpolationMode = InterpolationMode.BILINEAR):
        super().__init__(size)


class CenterCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: Any) -> torch.Tensor:
        x = _to_tensor(image)
        top, left = (x.shape[1] - self.size) // 2, (x.shape[2] - self.size) // 2
        return x[:, top : top + self.size, left : left + self.size]


class RandomCrop(CenterCrop):
    def __call__(self, image: Any) -> torch.Tensor:
        x = _to_tensor(image)
        top = int(torch.randint(0, x.shape[1] - self.size + 1, (1,)))
        left = int(torch.randint(0, x.shape[2] - self.size + 1, (1,)))
        return x[:, top : top + self.size, left : left + self.size]


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: Any) -> torch.Tensor:
        x = _to_tensor(image)
        return x.flip(-1) if float(torch.rand(1)) < self.p else x


class Lambda:
    def __init__(self, function: Callable[[Any], Any]) -> None:
        self.function = function

    def __call__(self, image: Any) -> Any:
        return self.function(image)


class PILToTensor:
    def __call__(self, image: Any) -> torch.Tensor:
        array = np.asarray(image).copy()
        return torch.from_numpy(array if array.ndim == 3 else array[:, :, None]).permute(2, 0, 1)


class ConvertImageDtype:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.dtype.is_floating_point:
            return image.to(self.dtype)
        return image.to(self.dtype) / torch.iinfo(image.dtype).max
