"""pytest fixtures for testing accel plugins. Registered with pytest through the ``pytest11`` entry point of
accel-kernel, so they are available in any test session where accel is installed (they do nothing unless used).

- ``accel_env``: this test's ``ACCEL_HOME`` (a tmp dir, set in ``os.environ``), so no user config leaks in.
- ``accel_kernel``: ``accel_kernel(["mine"], extra=[...], **Kernel_kwargs)`` builds a Kernel with only those
  plugins registered (see :func:`accel.testing.make_kernel`); every kernel it built is ended after the test.
- ``accel_launch``: ``accel_launch(["--plugin", "mine", "train.py"], num_processes=2, registered=[...])`` runs
  ``accel launch`` in a subprocess with this test's ``ACCEL_HOME`` (see :func:`accel.testing.run_launch`).
- marker ``requires_plugins("ddp", ...)``: the test also needs these other plugins installed (a plugin's test that
  works with a second one); skipped, naming them, in an environment without them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from accel.testing import make_kernel, run_launch


def pytest_configure(config: pytest.Config) -> None:
    """The markers accel's conformance suites use, so ``--strict-markers`` accepts them in any project."""
    config.addinivalue_line("markers", "multiprocess: starts several real processes (accel launch -n 2)")
    config.addinivalue_line("markers", "slow: takes more than ~20 s")
    config.addinivalue_line(
        "markers", "requires_plugins(*names): also needs these accel plugins installed; skipped without them"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``requires_plugins(...)`` when one of those plugins is not installed (no entry point)."""
    wanted = [name for mark in item.iter_markers("requires_plugins") for name in mark.args]
    if wanted:
        from accel.plugins import scan_entry_points

        installed = {record.name for record in scan_entry_points()}
        missing = [name for name in wanted if name not in installed]
        if missing:
            pytest.skip(f"needs accel plugin(s) {', '.join(missing)} installed too")


@pytest.fixture
def accel_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "accel_home"
    home.mkdir()
    monkeypatch.setenv("ACCEL_HOME", str(home))
    for var in ("ACCEL_CONFIG", "ACCEL_PLUGINS", "ACCEL_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def accel_kernel(accel_env: Path) -> Iterator[Callable[..., Any]]:
    built: list[Any] = []

    def build(registered: list[str] | tuple[str, ...] = (), extra: Any = (), **kwargs: Any) -> Any:
        kernel = make_kernel(registered, extra, **kwargs)
        built.append(kernel)
        return kernel

    yield build
    for kernel in reversed(built):
        kernel.end_training()


@pytest.fixture
def accel_launch(accel_env: Path) -> Callable[..., Any]:
    def launch(args: list[str], **kwargs: Any) -> Any:
        kwargs.setdefault("home", accel_env)
        return run_launch(args, **kwargs)

    return launch
