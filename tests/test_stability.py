"""Stability of the plugin contract (docs/plugin-api.md, "Stability"): semantic versions and kernel pins of every
distribution, their project metadata, the deprecation table's two phases (a deprecated hook, kit method or name
works with a warning naming its replacement; after its removal release it fails with one line naming it), and last
release's walk-through plugins (tests/fixtures/plugins_0_1) installed for real and passing their own tests."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch
from clitools import install, run_plugin_tests
from packaging.requirements import Requirement

import accel
import accel.spi
from accel import Component, PluginError, hookimpl, hookspecs
from accel.commands.new_plugin import KERNEL_REQUIREMENT
from accel.deprecations import DEPRECATIONS, Deprecation, release
from accel.testing import isolated_env, make_kernel
from accel.testing.conformance import TrackerConformance

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = [ROOT / "kernel" / "pyproject.toml", *sorted((ROOT / "plugins").glob("*/pyproject.toml"))]
FIXTURES = ROOT / "tests" / "fixtures" / "plugins_0_1"
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)")
#: The repository every distribution's project URLs point into (docs/design.md, "Stability: versions, ...").
REPOSITORY = "https://github.com/accel-dev/accel"


def project(path: Path) -> dict[str, Any]:
    return dict(tomllib.loads(path.read_text(encoding="utf-8"))["project"])


KERNEL_VERSION = project(PYPROJECTS[0])["version"]


def next_breaking(version: str) -> str:
    """The first release that may remove something: the next minor before 1.0 (0.1.x -> 0.2.0), else the next major."""
    major, minor, _ = release(version)
    return f"0.{minor + 1}.0" if major == 0 else f"{major + 1}.0.0"


# ---- versions, pins, metadata -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PYPROJECTS, ids=lambda p: p.parent.name)
def test_version_is_semver_and_the_kernel_pin_admits_this_kernel_only_up_to_the_next_breaking_release(
    path: Path,
) -> None:
    meta = project(path)
    assert SEMVER.fullmatch(meta["version"]), f"{path}: version {meta['version']!r} is not MAJOR.MINOR.PATCH"
    if path.parent.name == "kernel":
        return
    pins = [Requirement(d) for d in meta["dependencies"] if Requirement(d).name == "accel-kernel"]
    assert len(pins) == 1, f"{path}: no accel-kernel requirement"
    assert pins[0].specifier.contains(KERNEL_VERSION), f"{path}: {pins[0]} refuses accel-kernel {KERNEL_VERSION}"
    assert not pins[0].specifier.contains(next_breaking(KERNEL_VERSION)), f"{path}: {pins[0]} has no upper bound"


def test_installed_kernel_and_new_plugin_pin_agree_with_the_pyproject() -> None:
    assert accel.__version__ == KERNEL_VERSION, "reinstall the kernel (make setup) after changing its version"
    pin = Requirement(KERNEL_REQUIREMENT)
    assert pin.specifier.contains(KERNEL_VERSION) and not pin.specifier.contains(next_breaking(KERNEL_VERSION))
    # API_VERSION's major counts breaking releases of the contract; a minor release of it adds or deprecates.
    assert isinstance(accel.spi.API_VERSION, tuple) and len(accel.spi.API_VERSION) == 2


@pytest.mark.parametrize("path", PYPROJECTS, ids=lambda p: p.parent.name)
def test_every_distribution_names_its_authors_and_project_urls(path: Path) -> None:
    meta = project(path)
    assert meta.get("authors") and all(a.get("name") for a in meta["authors"]), f"{path}: no authors"
    folder = path.parent.relative_to(ROOT).as_posix()
    assert meta.get("urls") == {
        "Homepage": REPOSITORY,
        "Source": f"{REPOSITORY}/tree/main/{folder}",
        "Issues": f"{REPOSITORY}/issues",
        "Changelog": f"{REPOSITORY}/blob/main/CHANGELOG.md",
    }


# ---- the deprecation table -------------------------------------------------------------------------------------


def test_the_table_is_consistent_with_the_contract() -> None:
    for entry in DEPRECATIONS.values():
        assert entry.kind in ("hook", "kit", "name")
        assert release(entry.deprecated_in) < release(entry.removed_in)
        assert release(entry.deprecated_in) <= release(KERNEL_VERSION), f"{entry.name}: deprecated in the future"
        spec = getattr(hookspecs, entry.name, None) if entry.kind == "hook" else None
        if entry.kind == "hook" and entry.removed():
            assert spec is None, f"{entry.name} was removed in {entry.removed_in}: delete its hookspec"
        elif entry.kind == "hook":
            opts = getattr(spec, "accel_spec", None)
            assert opts is not None, f"{entry.name} is deprecated, not removed: it must stay a hookspec"
            warning = opts["warn_on_impl"]
            assert isinstance(warning, DeprecationWarning) and entry.replacement in str(warning)


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Deprecation]]:
    """The real table, which a test may change (entries it adds or moves to their removal phase are undone)."""
    monkeypatch.setattr("accel.deprecations.DEPRECATIONS", dict(DEPRECATIONS))
    import accel.deprecations

    yield accel.deprecations.DEPRECATIONS


def removed_now(table: dict[str, Deprecation], name: str) -> None:
    """Move ``name`` to its removal phase: a removed-in version at or before the installed kernel's."""
    table[name] = dataclasses.replace(table[name], removed_in=KERNEL_VERSION)


class Wrapped(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class OldStrategy(Component):
    """A strategy written for accel-kernel 0.1.0: it answers the hooks 0.1.1 deprecated."""

    role = "strategy"

    def __init__(self) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []

    @hookimpl
    def accel_wrap_model(self, kernel: Any, model: torch.nn.Module) -> torch.nn.Module:
        return Wrapped(model.to(kernel.device))

    @hookimpl
    def accel_wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.optimizers.append(optimizer)
        return optimizer


class Activates:
    """A plugin whose ``accel_activate`` returns ``component``."""

    def __init__(self, component: Component) -> None:
        self.component = component

    @hookimpl
    def accel_activate(self) -> Component:
        return self.component


def test_a_strategy_answering_the_deprecated_wrap_hooks_still_wraps_with_a_warning_naming_the_replacement() -> None:
    strategy = OldStrategy()
    with pytest.warns(DeprecationWarning) as caught:
        kernel = make_kernel(extra=[("old", Activates(strategy))])
    messages = {str(w.message).split(" is deprecated")[0]: str(w.message) for w in caught}
    for hook in ("accel_wrap_model", "accel_wrap_optimizer"):
        assert "since accel-kernel 0.1.1 and fails from 0.2.0: use accel_prepare_training" in messages[hook]
    try:
        model, optimizer = torch.nn.Linear(2, 1), None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        prepared_model, prepared_optimizer = kernel.prepare(model, optimizer)
        assert isinstance(prepared_model, Wrapped) and prepared_model.inner is model
        assert strategy.optimizers == [optimizer] and prepared_optimizer.optimizer is optimizer
        kernel.backward(prepared_model(torch.ones(4, 2)).sum())
        prepared_optimizer.step()
    finally:
        kernel.end_training()


def test_without_an_answer_the_default_places_models_and_keeps_optimizers() -> None:
    kernel = make_kernel()
    try:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        prepared_model, prepared_optimizer = kernel.prepare(model, optimizer)
        assert prepared_model is model and prepared_optimizer.optimizer is optimizer
    finally:
        kernel.end_training()


def test_after_its_removal_release_a_hook_fails_in_one_line_naming_its_replacement(
    table: dict[str, Deprecation],
) -> None:
    removed_now(table, "accel_wrap_model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(PluginError) as caught:
            make_kernel(extra=[("old", Activates(OldStrategy()))])
    message = str(caught.value)
    assert "\n" not in message
    assert f"accel_wrap_model was removed in accel-kernel {KERNEL_VERSION}: use accel_prepare_training" in message


def test_a_misspelt_deprecated_hook_suggests_its_replacement() -> None:
    class Misspelt(Component):
        @hookimpl
        def accel_wrap_modle(self, model: Any) -> Any:
            return model

    with pytest.raises(PluginError, match=r"unknown hook 'accel_wrap_modle'; did you mean `accel_prepare_training`\?"):
        make_kernel(extra=[("typo", Activates(Misspelt()))])


class OldSuite(TrackerConformance):
    """A conformance suite written for accel-kernel 0.1.0: it reads back with ``read_scalars``."""

    def read_scalars(self, tmp_path: Path, project: str) -> dict[str, dict[int, float]]:
        return {"loss": {1: 0.5, 0: 1.0}}


def test_the_kit_reads_a_0_1_suite_through_read_scalars_with_a_warning(tmp_path: Path) -> None:
    with pytest.warns(
        DeprecationWarning, match="TrackerConformance.read_scalars .* use TrackerConformance.read_series"
    ):
        assert OldSuite().read_series(tmp_path, "p") == {"loss": [(0, 1.0), (1, 0.5)]}


def test_after_its_removal_release_the_kit_method_fails_naming_its_replacement(
    tmp_path: Path, table: dict[str, Deprecation]
) -> None:
    removed_now(table, "TrackerConformance.read_scalars")
    with pytest.raises(PluginError, match="read_scalars was removed in .*: use TrackerConformance.read_series"):
        OldSuite().read_series(tmp_path, "p")


def test_a_deprecated_name_resolves_to_its_replacement_then_fails_naming_it(table: dict[str, Deprecation]) -> None:
    table["accel.spi.Part"] = Deprecation("accel.spi.Part", "accel.spi.Component", "0.1.1", "0.2.0", "renamed", "name")
    with pytest.warns(DeprecationWarning, match="accel.spi.Part is deprecated .* use accel.spi.Component"):
        assert accel.spi.Part is Component  # type: ignore[attr-defined]
    removed_now(table, "accel.spi.Part")
    with pytest.raises(
        AttributeError, match=r"^accel.spi.Part was removed in .*: use accel.spi.Component \(renamed\)$"
    ):
        accel.spi.Part  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(AttributeError, match="module 'accel' has no attribute 'Nothing'"):
        accel.Nothing  # type: ignore[attr-defined]  # noqa: B018


def test_the_changelog_gives_every_deprecation_its_migration() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{KERNEL_VERSION}]" in changelog and "## [0.1.0]" in changelog
    current = changelog.split(f"## [{KERNEL_VERSION}]", 1)[1].split("\n## [", 1)[0]
    for entry in DEPRECATIONS.values():
        if release(entry.deprecated_in) == release(KERNEL_VERSION):
            assert f"`{entry.name}`" in current and f"`{entry.replacement}`" in current, entry.name


# ---- last release's plugins -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "warnings"),
    [
        (
            "jsonl",
            [
                "TrackerConformance.read_scalars is deprecated since accel-kernel",
                # it imports accel.tracking, which is not the plugin API (accel.spi)
                "accel.tracking.requested is deprecated since accel-kernel 0.1.1 and fails from 0.2.0: use "
                "accel.spi.requested",
                "accel.tracking.as_scalar is deprecated since accel-kernel 0.1.1 and fails from 0.2.0: use "
                "accel.spi.as_scalar",
            ],
        ),
        ("avgdp", ["accel_wrap_model is deprecated since accel-kernel"]),
    ],
)
def test_last_releases_walkthrough_plugins_install_and_pass_their_own_tests(
    name: str, warnings: list[str], tmp_path: Path
) -> None:
    """The walk-through's plugins as accel-kernel 0.1.0's `accel new-plugin` wrote them, installed by pip (into a
    directory of their own, first on the path: the old accel-plugin-jsonl hides this repository's), pass their own
    tests against this kernel, with the deprecation warnings of what they use."""
    site = install(f"accel-plugin-{name}", source=FIXTURES)
    source = shutil.copytree(FIXTURES / f"accel-plugin-{name}", tmp_path / f"accel-plugin-{name}")  # its tests
    env = isolated_env(tmp_path / "home", extra={"PYTHONPATH": str(site)})
    probe = (
        f"import accel_{name}, importlib.metadata as m; print(accel_{name}.__file__, m.version('accel-plugin-{name}'))"
    )
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert found.stdout.split() == [str(site / f"accel_{name}" / "__init__.py"), "0.1.0"], found.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "accel.commands.cli", "plugins", "--json"], env=env, capture_output=True, text=True
    )
    row = {r["name"]: r for r in json.loads(listed.stdout)}[name]
    assert row["status"] == "active" and row["version"] == "0.1.0", row
    if name == "avgdp":  # `accel plugins` says what the plugin must change before 0.2.0, and so does a launch
        assert row["reason"] == "accel_wrap_model is deprecated, fails from 0.2.0: use accel_prepare_training", row
        (tmp_path / "train.py").write_text("print('hello')\n")
        launch = [sys.executable, "-m", "accel.commands.cli", "launch", "--dry-run", "--plugin", name, "-n", "2"]
        launched = subprocess.run([*launch, "train.py"], env=env, capture_output=True, text=True, cwd=tmp_path)
        assert launched.returncode == 0, launched.stderr
        assert (
            "accel: plugin 'avgdp' (accel-plugin-avgdp 0.1.0) uses a deprecated hook: accel_wrap_model is "
            "deprecated, fails from 0.2.0: use accel_prepare_training"
        ) in launched.stderr.splitlines(), launched.stderr
    output = run_plugin_tests(sys.executable, source, env, "-W", "always::DeprecationWarning")
    for warning in warnings:
        assert "DeprecationWarning: " + warning in output, (warning, output[-3000:])
