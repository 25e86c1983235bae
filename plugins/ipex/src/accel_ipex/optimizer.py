"""The IPEX component: ``ipex.optimize(model, optimizer, dtype=...)`` on each model and its optimizer, inside
``prepare()``, before the strategy places and wraps them. torch and intel_extension_for_pytorch are imported inside
methods, so listing and launching never load them.

Role ``"optimization"``: not a strategy (it starts no processes and wraps nothing, so it combines with ddp or the
single-process kernel), not the precision plugin (accel-plugin-amp may be active beside it) and not the compiler
(accel-plugin-dynamo may compile the same model). Roles outside strategy/compiler/precision may repeat and are asked
after those three.

- ``accel_prepare_training`` (a wrapper around whoever answers it): pairs every model with the optimizer that holds
  its parameters and calls ``ipex.optimize(..., inplace=True)`` on the pair, then lets the strategy (DDP) or the
  kernel's default place and wrap the optimized objects. In place keeps the user's module the one ``unwrap_model``
  returns; IPEX replaces its Conv/Linear children with prepacked ``_IPEXConv2d``/``_IPEXLinear`` modules, patches
  the optimizer's ``step`` with a fused update (SGD, Adam, Adagrad, Lamb, Lars on CPU) and both ``state_dict``
  methods so that checkpoints and ``save_model`` hold plain fp32 tensors under the original names.
- bf16 (``mixed_precision="bf16"``): ``ipex.optimize(dtype=torch.bfloat16)`` stores the weights in bf16 with fp32
  master weights (split into bf16 top halves and the optimizer's bf16 "trail" halves for fused optimizers, a full fp32
  copy otherwise). The forward must then run under CPU/XPU autocast: the precision plugin's (accel-plugin-amp) when
  one is active (it is in charge of precision), or else this component's ``accel_autocast`` (the same
  ``torch.autocast(device, dtype=torch.bfloat16)``). So ipex provides ``precision:bf16`` on its own.
  IPEX prepacks bf16 weights into oneDNN's blocked layouts only on a CPU with the instructions oneDNN's bf16 kernels
  need (avx512bw, avx512vl and avx512dq, or avx_ne_convert; ``onednn_has_bf16_support()``); on any other CPU
  ``ipex.optimize`` raises an AssertionError. There the plugin passes ``weights_prepack=False`` and warns once: the
  weights are still bf16 with fp32 master weights and the fused step, in the model's own Conv/Linear modules.
- Strategies: one process or a strategy that keeps every parameter whole on each process (ddp). A strategy that
  declares ``"sharding"`` in its ``provides`` (fsdp, deepspeed) would shard IPEX's prepacked, split bf16 weights:
  refused.
- Device: the Intel GPU (XPU) where torch sees one (the kernel's and DDP's device choice already follow
  ``torch.accelerator``); ``ipex_config.use_xpu`` makes its absence an error. A CUDA device is refused.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from accel.spi import Component, Settings, UsageError, hookimpl

if TYPE_CHECKING:
    import torch

    from accel.spi import KernelView


def _describe(obj: Any) -> str:
    return type(obj).__name__


def pair_models_and_optimizers(models: list[Any], optimizers: list[Any]) -> dict[int, int | None]:
    """For each model index, the index of the one optimizer that holds its parameters (or None). A UsageError for
    what ``ipex.optimize`` (one model with one optimizer) cannot take."""
    owner: dict[int, int] = {}  # id(parameter) -> model index
    for i, model in enumerate(models):
        for p in model.parameters():
            owner.setdefault(id(p), i)
    pairs: dict[int, int | None] = {i: None for i in range(len(models))}
    for j, opt in enumerate(optimizers):
        holders = {owner.get(id(p)) for group in opt.param_groups for p in group["params"]}
        if len(holders) > 1:
            what = "models prepared in other calls" if None in holders else f"{len(holders)} models"
            raise UsageError(
                f"plugin 'ipex': optimizer {_describe(opt)} holds parameters of {what}; ipex.optimize "
                "takes one model with one optimizer"
            )
        (m,) = holders or {None}
        if m is None:
            raise UsageError(
                f"plugin 'ipex': optimizer {_describe(opt)} was prepared without its model; "
                "ipex.optimize needs both, so pass the model and its optimizer to the same prepare() call"
            )
        paired = pairs[m]
        if paired is not None:
            raise UsageError(
                f"plugin 'ipex': model {_describe(models[m])} has two optimizers "
                f"({_describe(optimizers[paired])} and {_describe(opt)}); ipex.optimize takes one "
                "model with one optimizer"
            )
        pairs[m] = j
    return pairs


class IpexOptimizer(Component):
    """ipex.optimize on every (model, optimizer) pair of ``prepare()``; bf16 weights with fp32 master weights."""

    role = "optimization"
    provides = frozenset({"precision:bf16"})

    def __init__(self, settings: Settings):
        self.settings = settings
        self.bf16 = settings.mixed_precision == "bf16"
        self.level = str(settings["ipex_level"])
        #: (model, optimizer or None) as ipex.optimize returned them, in prepare order
        self.optimized: list[tuple[Any, Any]] = []
        self.warned_no_prepack = False

    # ---- set-up -------------------------------------------------------------------------------------------

    @hookimpl
    def accel_setup(self, kernel: KernelView) -> None:
        other = [c.name for c in kernel.components if c.role == "strategy" and "sharding" in c.provides]
        if other:
            raise UsageError(
                f"plugin 'ipex' runs on one process or with ddp; it cannot be combined with the "
                f"{other[0]!r} strategy (it would shard IPEX's prepacked weights)"
            )
        import torch

        if self.settings["ipex_use_xpu"] and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise UsageError(
                "ipex_config.use_xpu is set, but torch sees no Intel GPU (torch.xpu.is_available() is "
                "False); install the XPU builds of torch and intel-extension-for-pytorch, or drop use_xpu"
            )
        try:
            import intel_extension_for_pytorch  # noqa: F401  (fails here rather than in the middle of prepare)
        except Exception as exc:  # the versions matched (accel_unavailable_reason), so this is a broken install
            raise UsageError(
                f"plugin 'ipex': intel_extension_for_pytorch cannot be imported: "
                f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            ) from None

    @hookimpl
    def accel_autocast(self, kernel: KernelView) -> Callable[[], AbstractContextManager[Any]] | None:
        """bf16 when no precision component is active (one is in charge of precision): IPEX's bf16 weights need
        the forward under autocast."""
        if not self.bf16 or any(c.role == "precision" for c in kernel.components):
            return None
        import torch

        return functools.partial(torch.autocast, kernel.device.type, dtype=torch.bfloat16)

    # ---- prepare ------------------------------------------------------------------------------------------

    def _check_device(self, device: torch.device) -> None:
        if device.type not in ("cpu", "xpu"):
            raise UsageError(
                f"plugin 'ipex' optimizes for Intel CPUs and GPUs (XPU), and this process trains on "
                f"{device}; pass --cpu (use_cpu) to train on the CPU with ipex, or drop --plugin ipex"
            )
        if self.settings["ipex_use_xpu"] and device.type != "xpu":
            raise UsageError(f"ipex_config.use_xpu is set, but this process trains on {device}")

    @hookimpl(wrapper=True)
    def accel_prepare_training(self, kernel: KernelView, models: list[Any], optimizers: list[Any]) -> Any:
        """Optimize each (model, optimizer) pair in place, then let the strategy or the kernel's default place and
        wrap them. If IPEX hands back another object (a bare ``nn.Linear`` becomes an ``_IPEXLinear``), it takes
        the original's place in this call's lists, so it is what gets wrapped and what ``unwrap_model`` returns."""
        if models:
            self._optimize(kernel, models, optimizers)
        return (yield)

    def _optimize(self, kernel: KernelView, models: list[Any], optimizers: list[Any]) -> None:
        import torch

        self._check_device(kernel.device)
        pairs = pair_models_and_optimizers(models, optimizers)
        import intel_extension_for_pytorch as ipex

        options: dict[str, Any] = {
            "dtype": torch.bfloat16 if self.bf16 else None,
            "level": self.level,
            "inplace": True,
            "weights_prepack": self._weights_prepack(kernel.device, ipex),
        }
        for i, j in pairs.items():
            model = models[i]
            optimizer = optimizers[j] if j is not None else None
            if optimizer is None:
                if model.training and any(p.requires_grad for p in model.parameters()):
                    raise UsageError(
                        f"plugin 'ipex': model {_describe(model)} is in training mode but no optimizer of "
                        "this prepare() call holds its parameters; prepare it together with its "
                        "optimizer, or call model.eval() first to optimize it for inference"
                    )
                if model.training:  # nothing to train and not in eval mode: leave it as it is
                    continue
            model.to(kernel.device)  # IPEX optimizes for the device the parameters are on
            if optimizer is None:
                new_model, new_optimizer = ipex.optimize(model, **options), None
            else:
                new_model, new_optimizer = ipex.optimize(model, optimizer=optimizer, **options)
            if new_model is not model:
                models[i] = new_model
            if j is not None and new_optimizer is not optimizer:
                optimizers[j] = new_optimizer
            self.optimized.append((new_model, new_optimizer))

    def _weights_prepack(self, device: torch.device, ipex: Any) -> bool | None:
        """``weights_prepack`` for ``ipex.optimize``: None (IPEX's default for the level), or False for bf16 on a
        CPU whose oneDNN has no bf16 kernels, where IPEX would refuse to prepack bf16 weights."""
        if not self.bf16 or device.type != "cpu" or ipex._C.onednn_has_bf16_support():
            return None
        if not self.warned_no_prepack:
            self.warned_no_prepack = True
            warnings.warn(
                "plugin 'ipex': this CPU lacks the instructions oneDNN's bf16 kernels need (avx512bw, avx512vl and "
                "avx512dq, or avx_ne_convert), so bf16 weights are not prepacked: training runs in bf16 on the "
                "model's own Conv/Linear layers, slower than on a CPU that has them",
                RuntimeWarning,
                stacklevel=2,
            )
        return False
