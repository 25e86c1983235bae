"""The torchrun command line the ddp plugin builds: torchrun parses it back to the same script and arguments."""

from __future__ import annotations

import pytest
from torch.distributed.run import parse_args

from accel import Settings
from accel.distributed import torchrun_args
from accel.options import resolve
from accel.plugins import Plugins


def settings(**values: object) -> Settings:
    options = Plugins.load(env={"ACCEL_PLUGINS": "ddp"}).options()
    resolved, sources = resolve(options, kwargs=values, env={})
    return Settings(resolved, sources, world_size=int(resolved["num_processes"]), phase="launch")


@pytest.mark.parametrize(
    "command, script, module, script_args",
    [
        (["train.py", "--start", "3", "--nnodes", "9"], "train.py", False, ["--start", "3", "--nnodes", "9"]),
        (["-m", "pkg.train", "--master_port", "1"], "pkg.train", True, ["--master_port", "1"]),
    ],
)
def test_script_options_are_not_taken_for_torchruns(command, script, module, script_args):
    args = parse_args(torchrun_args(settings(num_processes=2), command))
    assert (args.training_script, args.module, args.training_script_args) == (script, module, script_args)
    assert args.nproc_per_node == "2" and args.nnodes == "1"


def test_two_machines_static_and_c10d():
    static = parse_args(
        torchrun_args(
            settings(
                num_processes=4, num_machines=2, machine_rank=1, main_process_ip="10.1.2.3", main_process_port=29555
            ),
            ["t.py"],
        )
    )
    assert (static.nproc_per_node, static.nnodes, static.node_rank) == ("2", "2", 1)
    assert (static.master_addr, static.master_port) == ("10.1.2.3", 29555)
    c10d = parse_args(
        torchrun_args(
            settings(num_processes=2, num_machines=2, main_process_ip="10.1.2.3", rdzv_backend="c10d"), ["t.py"]
        )
    )
    assert (c10d.rdzv_backend, c10d.rdzv_endpoint) == ("c10d", "10.1.2.3:29500")
