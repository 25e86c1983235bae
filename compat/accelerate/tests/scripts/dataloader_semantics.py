"""What a script sees of Accelerate's prepared dataloaders, written for comparison with Hugging Face's Accelerate:
the classes along ``dl.batch_sampler`` (the nesting Accelerate's own test scripts inspect), the batches of two
epochs with and without ``use_seedable_sampler``, ``prepare_data_loader(dispatch_batches=True)`` and the batch
sizes with and without ``even_batches``. Run unchanged under ``python``, ``torchrun`` or ``accel launch``; it
writes ``OUT_DIR/result-<process>.json``.

    dataloader_semantics.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import accelerate
import torch
from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler, prepare_data_loader
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader


def chain(dl: Any) -> list[str]:
    """The class names from ``dl.batch_sampler`` down through ``batch_sampler``/``sampler`` attributes."""
    names, obj = [], dl.batch_sampler
    while obj is not None and len(names) < 4:
        names.append(type(obj).__name__)
        obj = getattr(obj, "batch_sampler", None) or getattr(obj, "sampler", None)
    return names


def epochs(dl: Any, count: int = 2) -> list[list[list[int]]]:
    return [[batch.tolist() for batch in dl] for _ in range(count)]


def fresh(**config: Any) -> Accelerator:
    AcceleratorState._reset_state()
    return Accelerator(dataloader_config=DataLoaderConfiguration(**config))


def main() -> None:
    out = Path(sys.argv[1])
    row: dict[str, Any] = {"accelerate": accelerate.__file__}

    set_seed(42)
    accelerator = fresh(use_seedable_sampler=True)
    row["world"] = accelerator.num_processes
    dl = accelerator.prepare(DataLoader(range(20), batch_size=3, shuffle=True))
    row["seedable_chain"] = chain(dl)
    row["seedable_shard"] = isinstance(dl.batch_sampler, BatchSamplerShard)
    inner = dl.batch_sampler.batch_sampler if accelerator.num_processes > 1 else dl.batch_sampler
    row["seedable_sampler"] = isinstance(inner.sampler, SeedableRandomSampler)
    row["seedable_epochs"] = epochs(dl)
    dl.set_epoch(0)
    row["seedable_again"] = epochs(dl, 1)

    set_seed(7)
    accelerator = fresh()
    dl = accelerator.prepare(DataLoader(range(20), batch_size=3, shuffle=True))
    row["generator_chain"] = chain(dl)
    row["generator_epochs"] = epochs(dl)

    dl = prepare_data_loader(DataLoader(range(16), batch_size=4), put_on_device=True, dispatch_batches=True)
    row["dispatched"] = epochs(dl, 1)
    dl = prepare_data_loader(
        DataLoader(range(16), batch_size=4), put_on_device=True, dispatch_batches=True, split_batches=True
    )
    row["dispatched_split"] = epochs(dl, 1)

    accelerator = fresh(even_batches=True)
    row["even"] = [len(b) for b in accelerator.prepare(DataLoader(torch.arange(7), batch_size=2))]
    accelerator = fresh(even_batches=False)
    row["uneven"] = []
    for size, batch_size in ((3, 1), (7, 2)):
        dl = accelerator.prepare(DataLoader(torch.arange(size), batch_size=batch_size))
        row["uneven"].append([len(dl), [len(b) for b in dl]])
    (out / f"result-{accelerator.process_index}.json").write_text(json.dumps(row))
    accelerator.end_training()  # the process group ends with the run (gloo may abort a process exiting in it)


if __name__ == "__main__":
    main()
