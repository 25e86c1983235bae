"""Where a run keeps its checkpoints: :class:`ProjectConfiguration` (Accelerate's) and how ``Kernel()`` completes it.
Kept apart from :mod:`accel.checkpoint`, which ``Kernel`` imports only when a checkpoint is saved or loaded."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from accel.errors import UsageError


@dataclass
class ProjectConfiguration:
    """Where a run keeps its checkpoints and how they are named (Accelerate's ``ProjectConfiguration``).

    With ``Kernel(project_dir=..., project_config=ProjectConfiguration(automatic_checkpoint_naming=True,
    total_limit=3))``, ``save_state()`` writes ``project_dir/checkpoints/checkpoint_<i>``, keeps the newest
    ``total_limit`` complete checkpoints, and ``load_state()`` resumes from the newest complete one. ``iteration``
    is the number the next automatic checkpoint gets; ``load_state`` sets it to one past the loaded checkpoint, and
    a save never reuses a number that exists on disk, so numbering continues across restarts.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0

    def __post_init__(self) -> None:
        if self.total_limit is not None and (not _is_int(self.total_limit) or self.total_limit < 1):
            raise UsageError(
                f"ProjectConfiguration(total_limit=...) must be a whole number of at least 1, or None; "
                f"got {self.total_limit!r}"
            )
        if not _is_int(self.iteration) or self.iteration < 0:
            raise UsageError(
                f"ProjectConfiguration(iteration=...) must be a whole number, 0 or more; got {self.iteration!r}"
            )
        for name in ("project_dir", "logging_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise UsageError(
                    f"ProjectConfiguration({name}=...) must be a path (str or os.PathLike) or None; got "
                    f"{type(value).__name__} {value!r}"
                )
        if not isinstance(self.automatic_checkpoint_naming, bool):
            raise UsageError(
                "ProjectConfiguration(automatic_checkpoint_naming=...) must be True or False; got "
                f"{self.automatic_checkpoint_naming!r}"
            )
        if self.project_dir is not None:
            self.project_dir = os.fspath(self.project_dir)
        if self.logging_dir is not None:
            self.logging_dir = os.fspath(self.logging_dir)


def _is_int(value: object) -> bool:
    """A whole number (an int or numpy integer), not a bool or a string such as "2"."""
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_project_config(config: object) -> None:
    """``Kernel(project_config=...)`` takes a :class:`ProjectConfiguration` (as Accelerate's ``Accelerator``)."""
    if config is not None and not isinstance(config, ProjectConfiguration):
        hint = f"; for a directory use Kernel(project_dir={config!r})" if isinstance(config, (str, os.PathLike)) else ""
        raise UsageError(
            f"Kernel(project_config=...) takes an accel.ProjectConfiguration, got "
            f"{type(config).__name__} {config!r}{hint}"
        )


def configure_project(config: ProjectConfiguration | None, project_dir: str | None) -> ProjectConfiguration:
    """The Kernel's project configuration: ``config`` (copied) with ``project_dir`` from the Kernel's settings."""
    config = dataclasses.replace(config) if config is not None else ProjectConfiguration()
    if project_dir is not None:
        if config.project_dir is not None and Path(config.project_dir) != Path(project_dir):
            raise UsageError(
                f"Kernel(project_dir={project_dir!r}) and ProjectConfiguration(project_dir="
                f"{config.project_dir!r}) differ; give the directory once"
            )
        config.project_dir = os.fspath(project_dir)
    if config.automatic_checkpoint_naming and config.project_dir is None:
        raise UsageError(
            "ProjectConfiguration(automatic_checkpoint_naming=True) needs a project directory: Kernel(project_dir=...)"
        )
    if config.logging_dir is None and config.project_dir is not None:
        config.logging_dir = config.project_dir
    return config
