"""The suite writes only under pytest's temp folder (the root conftest.py gives the session its own home and temp
directory): where this process and a process it starts find their home, temp directory and the caches of the
libraries the tests drive (torch's compile cache, Hugging Face's, wandb's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

WHERE = """
import json, os, tempfile
import datasets, huggingface_hub.constants as hub, wandb.env
from torch._inductor.runtime.cache_dir_utils import cache_dir
print(json.dumps({
    "home": os.path.expanduser("~"), "temp": tempfile.gettempdir(), "torch compile cache": cache_dir(),
    "datasets cache": datasets.config.HF_DATASETS_CACHE, "hub": hub.HF_HOME, "wandb cache": wandb.env.get_cache_dir(),
    "wandb data": wandb.env.get_data_dir(),
}, default=str))
"""


def test_this_process_writes_under_pytests_temp_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp()
    assert Path(os.path.expanduser("~")).is_relative_to(base)
    assert Path(tempfile.gettempdir()).is_relative_to(base)
    assert Path(tempfile.mkdtemp()).is_relative_to(base)


def test_a_started_process_and_its_libraries_write_there_too(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp()
    proc = subprocess.run([sys.executable, "-c", WHERE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    where = json.loads(proc.stdout.splitlines()[-1])
    outside = {name: path for name, path in where.items() if not Path(path).is_relative_to(base)}
    assert not outside, f"outside {base}: {outside}"
