"""Helpers for strategy plugins that own a torch.distributed process group (DDP, FSDP, DeepSpeed, ...)."""

from __future__ import annotations

import time


def barrier_if_initialized() -> None:
    """Wait for every process of the default group, if there is one. For ``accel_end_training`` (a normal end):
    no process then destroys its group while another one still talks to it. Never call it from
    ``accel_teardown``, which also runs after a failure, when the other processes may never arrive."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def destroy_process_group() -> None:
    """Destroy the default process group and give its worker threads a moment to let go of finished work.

    gloo's worker threads drop finished work (which holds Python tensors) after the caller was woken up; if that
    happens while the interpreter finalises, the thread cannot take the GIL and the process aborts with
    "terminate called without an active exception" (seen about once in ten runs under load)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(0.05)
