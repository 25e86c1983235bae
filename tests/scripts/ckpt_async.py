"""Asynchronous saves in a process of their own (one process, or under ``accel launch -n 2 --plugin ddp``).

    python ckpt_async.py DIR MODE [--limit-rank R --limit BYTES] [--mb 8]

Builds a model of about ``--mb`` MB (SGD with momentum), takes one step, then:

- ``exit``: ``save_state(DIR/ck, asynchronous=True)`` and leaves the interpreter at once (no end_training): the
  save must still be published, by the exit handler.
- ``next-save``: an asynchronous save to DIR/ck, then a synchronous save to DIR/ck2: the second call reports the
  first one's background failure.
- ``end-training``: an asynchronous save, then ``end_training()``, which reports its failure.

``--limit-rank R --limit BYTES``: process R sets RLIMIT_FSIZE to BYTES before saving (a full disk: the save's
part on the training thread writes no file, so only the background write fails). Each process prints
``returned <rank>`` when the asynchronous save returned and ``error <rank>: <message>`` for an error it caught.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

import torch
from torch import nn

from accel import Kernel


def say(line: str) -> None:
    """One line in one write: `accel launch` runs its processes unbuffered (python -u), where print() writes the
    text and the newline separately, and two processes' lines on one pipe could then run together (seen in a full
    run: "returned 0returned 1")."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("mode", choices=("exit", "next-save", "end-training"))
    parser.add_argument("--limit-rank", type=int, default=-1)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--mb", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    kernel = Kernel()
    width = 512
    layers = max(1, round(args.mb * 2**20 / (width * width * 4)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = kernel.prepare(model, opt)
    kernel.backward(model(torch.ones(2, width)).sum())
    opt.step()
    opt.zero_grad()
    if kernel.process_index == args.limit_rank:
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.limit, resource.RLIM_INFINITY))
    kernel.save_state(Path(args.dir) / "ck", asynchronous=True)
    say(f"returned {kernel.process_index}")
    if args.mode == "exit":
        return  # the atexit handler finishes the save
    try:
        if args.mode == "next-save":
            kernel.save_state(Path(args.dir) / "ck2")
        else:
            kernel.end_training()
    except Exception as exc:
        say(f"error {kernel.process_index}: {type(exc).__name__}: {exc}")
    kernel.end_training()


if __name__ == "__main__":
    main()
