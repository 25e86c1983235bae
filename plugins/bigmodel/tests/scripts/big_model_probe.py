"""Child process of plugins/bigmodel/tests/test_big_model.py and bench/big_model_load.py: writes a ~1 GB fp32 checkpoint, or loads
it under a memory budget in a fresh process and reports peak RSS (ru_maxrss) against the baseline measured after
the imports.

    python big_model_probe.py write DIR [--layers N] [--width D] [--shards K]
    python big_model_probe.py load DIR --budget 300MB --offload DIR [--api accel|accelerate] [--map auto|cpu]

``load`` prints one JSON line: baseline/after-load/peak RSS in bytes, load seconds, whether the output equals the
reference written by ``write``, and the device map's placement counts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the models the tests share (torch only)
from big_model_defs import Block  # noqa: E402


class BigNet(nn.Module):
    def __init__(self, layers: int = 30, width: int = 1024) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def write(folder: Path, layers: int, width: int, shards: int) -> None:
    torch.manual_seed(0)
    model = BigNet(layers, width).eval()
    for block in model.blocks:  # small residual updates keep 30 blocks' activations in range
        block.down.weight.data.mul_(0.1)
    x = torch.randn(2, 8, width)
    with torch.no_grad():
        y = model(x)
    folder.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    names = list(state)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: state[n].contiguous() for n in part}, os.fspath(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"x": x, "y": y}, os.fspath(folder.parent / f"{folder.name}-reference.safetensors"))
    print(json.dumps({"total_size": total, "layers": layers, "width": width}))


def load(folder: Path, budget: str, offload: str, api: str, device_map: str, layers: int, width: int) -> None:
    if api == "accel":
        from accel_bigmodel import init_empty_weights, load_checkpoint_and_dispatch
        from accel_bigmodel import loading as _loading  # noqa: F401  (import cost belongs to the baseline)
    else:
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    reference = load_file(os.fspath(folder.parent / f"{folder.name}-reference.safetensors"))
    baseline = maxrss()
    start = time.perf_counter()
    with init_empty_weights():
        model = BigNet(layers, width)
    kwargs = (
        {"device_map": {"": "cpu"}}
        if device_map == "cpu"
        else {"device_map": device_map, "max_memory": {"cpu": budget}, "offload_folder": offload}
    )
    model = load_checkpoint_and_dispatch(model, os.fspath(folder), no_split_module_classes=["Block"], **kwargs)
    load_seconds = time.perf_counter() - start
    after_load = maxrss()
    start = time.perf_counter()
    with torch.no_grad():
        out = model(reference["x"])
    forward_seconds = time.perf_counter() - start
    placed: dict[str, int] = {}
    for device in getattr(model, "hf_device_map", {"": "cpu"}).values():
        placed[str(device)] = placed.get(str(device), 0) + 1
    print(
        json.dumps(
            {
                "baseline": baseline,
                "after_load": after_load,
                "peak": maxrss(),
                "load_seconds": load_seconds,
                "forward_seconds": forward_seconds,
                "equal": bool(torch.equal(out, reference["y"])),
                "max_abs_diff": float((out - reference["y"]).abs().max()),
                "placed": placed,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["write", "load"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--budget", default="300MB")
    parser.add_argument("--offload", default="")
    parser.add_argument("--api", choices=["accel", "accelerate"], default="accel")
    parser.add_argument("--map", dest="device_map", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same kernels in writer and loader: outputs compare bit for bit
    if args.mode == "write":
        write(args.folder, args.layers, args.width, args.shards)
    else:
        load(args.folder, args.budget, args.offload, args.api, args.device_map, args.layers, args.width)


if __name__ == "__main__":
    main()
