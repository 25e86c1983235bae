"""accel-plugin-ipex: the entry-point module. Cheap to import: no torch and no intel_extension_for_pytorch here
(see ``optimizer.py``).

IPEX ties itself to one torch release: ``intel-extension-for-pytorch`` X.Y.* only runs with torch X.Y.*, yet its
package metadata does not say so, and importing it next to another torch prints an error and crashes. So the
plugin compares both versions from the installed distributions' metadata (``importlib.metadata``), never by
importing IPEX, and answers ``accel_unavailable_reason`` with the mismatch: ``accel plugins`` and ``accel env``
show the plugin as unavailable with that reason, and asking for it is one clear error.

Takes part when selected (``--plugin ipex``, ``Kernel(plugins=["ipex"])``) or asked for with Accelerate's keys:
``ipex_config.ipex: true`` in the config file, ``--ipex``, ``ACCELERATE_USE_IPEX=true`` (``use_ipex``). Unlike
Accelerate before 1.8, merely having IPEX installed changes nothing.
"""

from __future__ import annotations

import importlib.metadata as md

from packaging.version import InvalidVersion, Version

from accel.spi import Component, Options, Settings, UsageError, hookimpl

NAME = "ipex"
IPEX_DIST = "intel-extension-for-pytorch"
#: IPEX's last release line: upstream stopped after 2.8 and archived the project.
LAST_RELEASE = (2, 8)
accel_components = ["accel_ipex.optimizer:IpexOptimizer"]


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _major_minor(version: str) -> tuple[int, int] | None:
    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return (release[0], release[1] if len(release) > 1 else 0)


def compatibility_problem(ipex_version: str | None, torch_version: str | None) -> str | None:
    """Why this IPEX cannot run with this torch (one line), or None. IPEX X.Y.* requires torch X.Y.*."""
    if ipex_version is None:
        return (
            f"{IPEX_DIST} is not installed: install torch=={LAST_RELEASE[0]}.{LAST_RELEASE[1]}.* together with "
            f"{IPEX_DIST}=={LAST_RELEASE[0]}.{LAST_RELEASE[1]}.* (or pip install 'accel-plugin-ipex[ipex]' next "
            "to a matching torch)"
        )
    if torch_version is None:
        return f"{IPEX_DIST} {ipex_version} is installed but torch is not"
    wanted, found = _major_minor(ipex_version), _major_minor(torch_version)
    if wanted is None or found is None:
        return f"cannot compare the versions of {IPEX_DIST} ({ipex_version}) and torch ({torch_version})"
    if wanted == found:
        return None
    pin = f"{wanted[0]}.{wanted[1]}.*"
    if found > LAST_RELEASE:
        other = (
            f"or uninstall {IPEX_DIST} (its last release is {LAST_RELEASE[0]}.{LAST_RELEASE[1]}: none supports "
            f"torch {found[0]}.{found[1]})"
        )
    else:
        other = f"or install {IPEX_DIST}=={found[0]}.{found[1]}.*"
    return f"{IPEX_DIST} {ipex_version} needs torch {pin}, found {torch_version}: install torch=={pin} {other}"


@hookimpl
def accel_unavailable_reason() -> str | None:
    return compatibility_problem(_version(IPEX_DIST), _version("torch"))


@hookimpl
def accel_add_options(options: Options) -> None:
    # Accelerate's `ipex_config` section (v0.20-v1.7): `ipex` (its --ipex flag, ACCELERATE_USE_IPEX; transformers'
    # TrainingArguments.use_ipex sets that variable) and `use_xpu` (--use_xpu, ACCELERATE_USE_XPU).
    options.add(
        "use_ipex",
        type="bool",
        default=False,
        config_key="ipex_config.ipex",
        flags=("--ipex",),
        env=("ACCEL_USE_IPEX", "ACCELERATE_USE_IPEX"),
        help="Optimize models and optimizers with Intel Extension for PyTorch (same as --plugin ipex).",
    )
    options.add(
        "ipex_use_xpu",
        type="bool",
        default=False,
        config_key="ipex_config.use_xpu",
        flags=("--use_xpu",),
        env=("ACCEL_USE_XPU", "ACCELERATE_USE_XPU"),
        help="ipex: train on the Intel GPU (XPU); an error when torch sees none. Without it the XPU is "
        "still used when present, unless --cpu.",
    )
    options.add(
        "ipex_level",
        default="O1",
        choices=("O0", "O1"),
        config_key="ipex_config.level",
        help="ipex.optimize level: O1 (fuse, prepack weights, fused optimizer step) or O0 (no changes "
        "except bf16 weights).",
    )


def check_settings(settings: Settings) -> None:
    """Combinations that cannot work, found from the settings alone (at ``accel launch`` and in ``Kernel()``)."""
    if settings.mixed_precision not in ("no", "bf16"):
        raise UsageError(
            f"plugin 'ipex' trains in fp32 or bf16 (ipex.optimize(dtype=torch.bfloat16)); "
            f"mixed_precision={settings.mixed_precision} is not supported with it: use bf16 or no"
        )
    if settings["ipex_use_xpu"] and settings["cpu"]:
        raise UsageError("ipex_config.use_xpu (train on the XPU) and use_cpu (--cpu) contradict each other; drop one")


@hookimpl
def accel_activate(settings: Settings) -> Component | None:
    if not (settings.is_selected(NAME) or settings["use_ipex"]):
        return None
    if accel_unavailable_reason() is not None:
        return None  # the kernel refuses the request with the reason (accel_unavailable_reason)
    check_settings(settings)
    from accel_ipex.optimizer import IpexOptimizer

    return IpexOptimizer(settings)
