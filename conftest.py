"""Every test folder's (kernel/tests, plugins/*/tests, tests/): each test gets the process environment back as it
found it, so a variable a test (or a library it drives, e.g. ``mlflow.set_tracking_uri``) writes into ``os.environ``
cannot reach the subprocesses of the tests after it.

torch builds C++ extensions (DeepSpeed's CPU ops) in ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``:
every test and every process it starts uses the checkout's ``.cache/torch_extensions`` instead (ignored by git; where
the DeepSpeed tests already built their op once), unless the caller set one. A run that is killed in the middle of a
build leaves a lock there that accel then refuses to launch beside (tests/test_fault_files.py): in ``~/.cache`` that
lock broke the next suite's DeepSpeed dry runs (test_config_tree, the DeepSpeed conformance class).

Every test, and every process it starts, writes only under pytest's temp folder: for the session ``HOME`` (and with
it ``~/.cache``, where wandb, Hugging Face datasets and pip would write), the XDG folders and the temp directory
(``TMPDIR``: torch's compile caches, multiprocessing's folders, launchers' records) are folders of its own there.

Warm workers (``tests/warm_workers``, CONTRIBUTING.md "Warm workers in the test suite"): the worker processes torchrun
starts for the session's tests are forked from a server that imported torch once, instead of importing it each
(2-4 CPU s per worker), where the venv has the hook ``make setup`` installs. ``WARM_WORKERS=0`` in the session's
environment turns this off for the session; in a launch's environment, for that launch's workers."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator

import pytest

os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache", "torch_extensions")
)


#: what the session's own folders replace, relative to its home (``TMPDIR``: its temp directory)
_PRIVATE = {
    "HOME": "",
    "XDG_CACHE_HOME": ".cache",
    "XDG_CONFIG_HOME": ".config",
    "XDG_DATA_HOME": ".local/share",
    "XDG_STATE_HOME": ".local/state",
    "TMPDIR": "tmp",
}
#: caches that would stay where the caller's environment points them; unset, they are found under the new home
_UNSET = ("HF_HOME", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR")


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path plugin has made its factory
def pytest_configure(config: pytest.Config) -> None:
    """The session's home and temp directory, set before the test modules are imported (a library imported there,
    such as Hugging Face datasets, reads where its cache goes when it is imported)."""
    from accel.testing import patched_environ

    factory: pytest.TempPathFactory = config._tmp_path_factory  # type: ignore[attr-defined]  # the session's own
    home = factory.mktemp("home", numbered=False)
    values: dict[str, str | None] = {name: str(home / where) for name, where in _PRIVATE.items()}
    values.update(dict.fromkeys(_UNSET))
    for name in _PRIVATE:
        os.makedirs(str(values[name]), exist_ok=True)
    patched = patched_environ(values)
    patched.__enter__()
    tempfile.tempdir = None  # read TMPDIR again

    def restore() -> None:
        patched.__exit__(None, None, None)
        tempfile.tempdir = None

    config.add_cleanup(restore)


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True, scope="session")
def _warm_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if os.environ.get("WARM_WORKERS", "1") == "0":
        yield
        return
    from accel.testing import patched_environ

    folder = tmp_path_factory.mktemp("warm")
    try:
        with patched_environ({"WARM_WORKERS_DIR": str(folder), "WARM_WORKERS_OWNER": str(os.getpid())}):
            yield
    finally:
        for pid_file in folder.glob("*.pid"):  # the servers: each kills what it still runs when its owner is gone
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
