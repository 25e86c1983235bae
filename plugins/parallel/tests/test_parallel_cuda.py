"""accel-plugin-parallel on CUDA (NCCL): tensor parallel and context parallel, compared with one process.

Skipped without at least 2 CUDA GPUs. Context parallel cannot run on the CPU (torch shards scaled dot-product
attention only for its CUDA kernels), so this is where it is tested. Tolerances are looser than on the CPU: CUDA
picks different matmul and attention kernels for different shapes (sharded vs whole), and ring attention sums the
softmax blocks in another order: losses relative 1e-3, parameters absolute 1e-3 after 6 AdamW steps (lr 1e-2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_parallel import MODELS, launch, mesh, run

HERE = Path(__file__).parent

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs"
    ),
    pytest.mark.slow,
    pytest.mark.multiprocess,
]


def test_tensor_parallel_on_cuda_matches_one_process(tmp_path: Path) -> None:
    worker = HERE / "parallel_worker.py"
    ref = run([sys.executable, str(worker), str(tmp_path / "ref"), "--ref"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-4000:]
    launch(tmp_path, *mesh(2, tp=2), str(worker), str(tmp_path / "tp"))
    a, b = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("ref", "tp"))
    assert b["tp"] == 2 and b["param_type"] == "DTensor"
    for key in MODELS:
        assert b["losses"][key] == pytest.approx(a["losses"][key], rel=1e-3), key
        pa, pb = (load_file(str(tmp_path / d / f"{key}.safetensors")) for d in ("ref", "tp"))
        for name in pa:
            torch.testing.assert_close(pb[name], pa[name], rtol=0, atol=1e-3, msg=f"{key}.{name}")
    assert b["eval_seen"] == list(range(10))


def test_context_parallel_on_cuda_matches_one_process(tmp_path: Path) -> None:
    worker = HERE / "parallel_cp_worker.py"
    ref = run([sys.executable, str(worker), str(tmp_path / "ref"), "--ref"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-4000:]
    launch(tmp_path, *mesh(2, cp=2), str(worker), str(tmp_path / "cp"))
    a, b = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("ref", "cp"))
    assert a["device"].startswith("cuda") and b["device"].startswith("cuda") and b["world"] == 2
    assert b["losses"] == pytest.approx(a["losses"], rel=1e-3)
