"""save_state / load_state / save_model / skip_first_batches in one process.

Multi-process, restart, crash and elastic tests are in test_checkpoint_processes.py.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import accel
from accel import (
    CheckpointError,
    Component,
    ItemRecord,
    Kernel,
    PluginError,
    ProjectConfiguration,
    UsageError,
    hookimpl,
)
from accel.checkpoint import MANIFEST, load_weights_only, read_tree, write_tree


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ACCEL_CONFIG", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])


def make_run(tmp_path: Path | None = None, width: int = 8, optimizers: int = 1, **kernel_kwargs: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    kernel = Kernel(**kernel_kwargs)
    model = nn.Sequential(nn.Linear(4, width), nn.Dropout(0.2), nn.Linear(width, 2))
    opts = [torch.optim.AdamW(model.parameters(), lr=1e-2) for _ in range(optimizers)]
    sched = torch.optim.lr_scheduler.StepLR(opts[0], 3)
    gen = torch.Generator().manual_seed(1)
    dl = DataLoader(
        TensorDataset(torch.randn(50, 4, generator=gen), torch.randn(50, 2, generator=gen)), batch_size=4, shuffle=True
    )
    model, *rest = kernel.prepare(model, *opts, dl, sched)
    opts, dl, sched = rest[:optimizers], rest[optimizers], rest[optimizers + 1]
    return {"kernel": kernel, "model": model, "opt": opts[0], "opts": opts, "dl": dl, "sched": sched}


def train(run: dict[str, Any], steps: int) -> None:
    kernel, model, opt, sched = run["kernel"], run["model"], run["opt"], run["sched"]
    it = iter(run["dl"])
    for _ in range(steps):
        x, y = next(it)
        loss = ((model(x) - y) ** 2).mean()
        kernel.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    run["it"] = it  # keep the pass open (a dropped iterator counts as an abandoned pass)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the accel.tree format ----------------------------------------------------------------------------------


def test_tree_round_trip_keeps_types_and_tied_tensors(tmp_path: Path) -> None:
    w = torch.randn(3, 4)
    base = torch.arange(10.0)
    obj = {
        "w": w,
        "tied": w,
        "view_a": base[:4],
        "view_b": base[2:8],
        "empty": torch.empty(0),
        "scalar": torch.tensor(2.5),
        "half": torch.ones(2, dtype=torch.bfloat16),
        "ints": {0: torch.zeros(2), 7: "x"},
        "tuple": (1, 2.5, None, True),
        "floats": [math.inf, -math.inf, 1e-300],
        "nan": math.nan,
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "set": {3, 1},
        "bytes": b"\x00\xff",
        "np": np.arange(5, dtype=np.uint32),
        "np_scalar": np.float64(0.5),
        "__dunder": 1,
        "nested": {"a": [{"b": (torch.ones(1),)}]},
    }
    files = write_tree(tmp_path, "thing", obj)
    assert sorted(files) == ["thing.json", "thing.safetensors"]
    back = read_tree(tmp_path, "thing")
    assert torch.equal(back["w"], w) and back["tied"] is back["w"]
    assert torch.equal(back["view_a"], base[:4]) and torch.equal(back["view_b"], base[2:8])
    assert back["empty"].shape == (0,) and back["scalar"].item() == 2.5 and back["half"].dtype == torch.bfloat16
    assert set(back["ints"]) == {0, 7} and back["ints"][7] == "x"
    assert back["tuple"] == (1, 2.5, None, True) and isinstance(back["tuple"], tuple)
    assert back["floats"][:2] == [math.inf, -math.inf] and math.isnan(back["nan"])
    assert (
        back["dtype"] is torch.float16 and back["device"] == torch.device("cpu") and back["size"] == torch.Size([2, 3])
    )
    assert back["set"] == {1, 3} and back["bytes"] == b"\x00\xff" and back["__dunder"] == 1
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2, 3, 4] and back["np_scalar"] == 0.5
    assert torch.equal(back["nested"]["a"][0]["b"][0], torch.ones(1))


def test_tree_refuses_arbitrary_objects(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"cannot store an object of type .*Counter at 'a.b'"):
        write_tree(tmp_path, "x", {"a": {"b": Counter()}})


# ---- save_state / load_state --------------------------------------------------------------------------------


@pytest.mark.smoke
def test_save_and_load_restore_everything(tmp_path: Path) -> None:
    run = make_run()
    counter = Counter(5)
    run["kernel"].register_for_checkpointing(counter)
    train(run, 3)
    path = run["kernel"].save_state(tmp_path / "ck")
    saved = params(run["model"])
    saved_opt = copy.deepcopy(run["opt"].state_dict())
    saved_sched = run["sched"].state_dict()
    files = sorted(os.listdir(path))
    assert all(f.endswith((".json", ".safetensors")) for f in files), files
    assert MANIFEST in files and "model.safetensors" in files and "rng_rank0.json" in files
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()

    train(run, 4)  # move everything on
    counter.value = 99
    torch.rand(3), random.random(), np.random.rand()
    run["kernel"].load_state(path)
    assert all(torch.equal(v, saved[k]) for k, v in params(run["model"]).items())
    restored = run["opt"].state_dict()
    assert restored["param_groups"] == saved_opt["param_groups"]
    for i, st in saved_opt["state"].items():
        assert all(torch.equal(v, restored["state"][i][n]) for n, v in st.items())
    assert run["sched"].state_dict() == saved_sched and counter.value == 5
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    assert np.array_equal(np.random.get_state()[1], np_state)


def test_loading_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run()
    train(run, 2)
    path = run["kernel"].save_state(tmp_path / "ck")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("load_state unpickled something")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    run["kernel"].load_state(path)


class Evil:
    """A pickle whose loading would create a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.write_text, (self.marker, "pwned"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickles_are_refused_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Evil(marker))
    pickle.loads(pickle.dumps(Evil(tmp_path / "control")))
    assert (tmp_path / "control").exists(), "the payload must really execute when unpickled"
    run = make_run()
    train(run, 2)
    path = Path(run["kernel"].save_state(tmp_path / "ck"))

    # 1. a stray pickle in the checkpoint (Accelerate's file name) is never opened: the load is refused
    (path / "random_states_0.pkl").write_bytes(payload)
    with pytest.raises(CheckpointError, match="does not list: random_states_0.pkl"):
        run["kernel"].load_state(path)
    (path / "random_states_0.pkl").unlink()

    # 2. a listed file replaced by the pickle, manifest forged to match: safetensors rejects it, nothing runs
    (path / "optimizer.safetensors").write_bytes(payload)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["optimizer.safetensors"] = len(payload)
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot read .*optimizer.safetensors"):
        run["kernel"].load_state(path)

    # 3. a torch file written by a plugin that is a pickle: weights-only loading refuses it
    torch_file = tmp_path / "plugin_state.pt"
    torch_file.write_bytes(payload)
    with pytest.raises(CheckpointError, match="refusing to load .*not a weights-only torch file"):
        load_weights_only(torch_file)

    # 4. a pickled metadata file (torch.distributed.checkpoint's format) read with an allow-list of globals
    from accel.checkpoint import DCP_METADATA_GLOBALS, load_restricted_pickle

    with pytest.raises(CheckpointError, match="references pathlib.Path.write_text, which is not allowed"):
        load_restricted_pickle(torch_file, DCP_METADATA_GLOBALS)

    # 5. an Accelerate-style directory (pickles, no manifest)
    foreign = tmp_path / "accelerate_ckpt"
    foreign.mkdir()
    (foreign / "random_states_0.pkl").write_bytes(payload)
    (foreign / "optimizer.bin").write_bytes(payload)
    with pytest.raises(CheckpointError, match="not a complete accel checkpoint"):
        run["kernel"].load_state(foreign)
    assert not marker.exists()


def test_compatibility_errors_before_touching_the_model(tmp_path: Path) -> None:
    run = make_run()
    train(run, 2)
    path = run["kernel"].save_state(tmp_path / "ck")

    wider = make_run(width=9)
    before = params(wider["model"])
    with pytest.raises(
        CheckpointError,
        match=r"'model' does not fit this model: 0.weight has shape \(8, 4\) in the "
        r"checkpoint, \(9, 4\) in this model",
    ):
        wider["kernel"].load_state(path)
    assert all(torch.equal(v, before[k]) for k, v in params(wider["model"]).items())

    two = make_run(optimizers=2)
    with pytest.raises(
        CheckpointError,
        match=r"has no 'optimizer_1' \(this run has 'optimizer_1': a prepared "
        r"optimizer\)",
    ):
        two["kernel"].load_state(path)

    extra = make_run()
    extra["kernel"].register_for_checkpointing(Counter())
    with pytest.raises(CheckpointError, match=r"has no 'custom_0' .*register_for_checkpointing \(Counter\)"):
        extra["kernel"].load_state(path)
    path2 = extra["kernel"].save_state(tmp_path / "ck2")
    with pytest.raises(CheckpointError, match=r"holds 'custom_0' that this run does not have"):
        make_run()["kernel"].load_state(path2)

    manifest = json.loads((Path(path) / MANIFEST).read_text())
    manifest["items"]["rng"]["extra"]["world_size"] = 4
    (Path(path) / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError,
        match=r"'rng' holds one state per process for 4 process\(es\); this run "
        r"has 1",
    ):
        make_run()["kernel"].load_state(path)


def test_register_for_checkpointing_needs_state_dict() -> None:
    with pytest.raises(UsageError, match="object has no state_dict"):
        Kernel().register_for_checkpointing(object())


def test_save_state_refuses_to_overwrite_foreign_directory(tmp_path: Path) -> None:
    kernel = make_run()["kernel"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="not an accel checkpoint; refusing to overwrite"):
        kernel.save_state(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "nothing was written"


def test_overwriting_a_checkpoint_is_atomic_and_recoverable(tmp_path: Path) -> None:
    run = make_run()
    counter = Counter(1)
    run["kernel"].register_for_checkpointing(counter)
    target = tmp_path / "latest"
    run["kernel"].save_state(target)
    counter.value = 2
    run["kernel"].save_state(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    # simulate a crash between "set the old one aside" and "rename the new one into place"
    os.rename(target, tmp_path / ".latest.old-0123456789ab")
    counter.value = 0
    run["kernel"].load_state(target)
    assert counter.value == 2 and target.is_dir()
    # a crash in the middle of writing leaves a temporary directory; the next save of that target removes it
    (tmp_path / ".latest.tmp-00112233aabb").mkdir()
    run["kernel"].save_state(target)
    assert not (tmp_path / ".latest.tmp-00112233aabb").exists()


def test_automatic_naming_total_limit_and_latest(tmp_path: Path) -> None:
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    run = make_run(project_dir=tmp_path, project_config=config)
    counter = Counter()
    run["kernel"].register_for_checkpointing(counter)
    for i in range(4):
        counter.value = i
        assert Path(run["kernel"].save_state()).name == f"checkpoint_{i}"
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    assert run["kernel"].save_iteration == 4
    # an incomplete newer checkpoint and a leftover temporary directory are ignored
    (folder / "checkpoint_7").mkdir()
    (folder / "checkpoint_7" / "model.safetensors").write_bytes(b"partial")
    (folder / ".checkpoint_4.tmp-00aa11bb22cc").mkdir()
    counter.value = -1
    assert Path(run["kernel"].load_state()).name == "checkpoint_3" and counter.value == 3
    assert run["kernel"].latest_checkpoint() == folder / "checkpoint_3"
    # numbering never reuses a directory that exists, and stale temporaries are cleaned up
    assert Path(run["kernel"].save_state()).name == "checkpoint_8"
    assert not (folder / ".checkpoint_4.tmp-00aa11bb22cc").exists()


def test_project_configuration_checks() -> None:
    with pytest.raises(UsageError, match="total_limit"):
        ProjectConfiguration(total_limit=0)
    with pytest.raises(UsageError, match="needs a project directory"):
        Kernel(project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
    with pytest.raises(UsageError, match="save_state\\(\\) needs a directory"):
        Kernel().save_state()
    with pytest.raises(UsageError, match="load_state\\(\\) needs a directory"):
        Kernel().load_state()


def test_load_state_without_checkpoint_says_so(tmp_path: Path) -> None:
    kernel = Kernel(project_dir=tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        kernel.load_state()
    assert kernel.latest_checkpoint() is None


# ---- plugins claiming items ---------------------------------------------------------------------------------


class ClaimingComponent(Component):
    """Writes the model in its own format (one torch file per process) and adds a 'scaler' item."""

    role = "observer"

    def __init__(self, claim: str = "model") -> None:
        self.claim = claim
        self.scaler = Counter(7)
        self.loaded: list[str] = []

    @hookimpl
    def accel_state_items(self, kernel: Kernel) -> dict[str, Any]:
        return {"scaler": self.scaler} if self.claim == "model" else {}

    @hookimpl
    def accel_save_state(self, kernel: Kernel, items: Any, directory: Path) -> dict[str, ItemRecord]:
        model = kernel.unwrap_model(items[self.claim])
        name = f"{self.claim}_by_plugin_rank{kernel.process_index}.pt"
        torch.save(model.state_dict(), directory / name)
        return {self.claim: ItemRecord(plugin="ignored", format="torch-weights-only", files=(name,))}

    @hookimpl
    def accel_load_state(self, kernel: Kernel, items: Any, directory: Path, records: Any) -> list[str]:
        for key, rec in records.items():
            kernel.unwrap_model(items[key]).load_state_dict(load_weights_only(directory / rec.files[0]))
            self.loaded.append(key)
        return list(records)


class Activator:
    def __init__(self, component: Component) -> None:
        self.component = component

    @hookimpl
    def accel_activate(self, settings: Any) -> Component:
        return self.component


def test_plugin_claims_items_and_manifest_names_it(tmp_path: Path) -> None:
    comp = ClaimingComponent()
    run = make_run(extra_plugins=[("claimer", Activator(comp))])
    train(run, 2)
    path = Path(run["kernel"].save_state(tmp_path / "ck"))
    manifest = json.loads((path / MANIFEST).read_text())
    rec = manifest["items"]["model"]
    assert rec["plugin"] == "claimer" and rec["format"] == "torch-weights-only"
    assert rec["files"] == ["model_by_plugin_rank0.pt"] and not (path / "model.safetensors").exists()
    assert (
        manifest["items"]["scaler"]["plugin"] == "accel"
        and manifest["items"]["scaler"]["extra"]["provider"] == "claimer"
    )
    saved = params(run["model"])
    train(run, 2)
    comp.scaler.value = 0
    run["kernel"].load_state(path)
    assert comp.loaded == ["model"] and comp.scaler.value == 7
    assert all(torch.equal(v, saved[k]) for k, v in params(run["model"]).items())

    # the same checkpoint without the plugin: one clear error naming it
    with pytest.raises(
        CheckpointError,
        match=r"'model' of .* was written by plugin 'claimer' in format "
        r"'torch-weights-only'; install the plugin that provides 'claimer'",
    ):
        make_run()["kernel"].load_state(path)


def test_missing_published_plugin_gets_install_hint(tmp_path: Path) -> None:
    run = make_run()
    path = Path(run["kernel"].save_state(tmp_path / "ck"))
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["items"]["model"].update(plugin="fsdp", format="dcp", version="0.1.0")
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError,
        match=r"written by plugin 'fsdp' 0.1.0 in format 'dcp'; "
        r"(install it with `pip install accel-plugin-fsdp`|.*--plugin fsdp)",
    ):
        run["kernel"].load_state(path)


def test_two_plugins_claiming_one_item_is_an_error(tmp_path: Path) -> None:
    run = make_run(
        extra_plugins=[("one", Activator(ClaimingComponent("model"))), ("two", Activator(ClaimingComponent("model")))]
    )
    with pytest.raises(PluginError, match="is given by both 'one' and 'two'|is given by both 'two' and 'one'"):
        run["kernel"].save_state(tmp_path / "ck")
    run = make_run(
        extra_plugins=[
            ("one", Activator(ClaimingComponent("optimizer"))),
            ("two", Activator(ClaimingComponent("optimizer"))),
        ]
    )
    with pytest.raises(PluginError, match="'optimizer' is claimed by both"):
        run["kernel"].save_state(tmp_path / "ck")
    assert not any(p.name.startswith(".ck.tmp") for p in tmp_path.iterdir()), "the temporary directory is removed"


# ---- dataloader position ------------------------------------------------------------------------------------


class CountingDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loaded.append(i)
        return torch.tensor([i])


def test_skip_first_batches_does_not_load_skipped_batches() -> None:
    torch.manual_seed(3)
    kernel = Kernel()
    ds = CountingDataset(30)
    dl = kernel.prepare(DataLoader(ds, batch_size=4, shuffle=True))
    full = [b.flatten().tolist() for b in dl]  # epoch 0
    torch.manual_seed(3)
    kernel = Kernel()
    ds = CountingDataset(30)
    dl = kernel.prepare(DataLoader(ds, batch_size=4, shuffle=True))
    assert kernel.skip_first_batches(dl, 3) is dl
    tail = [b.flatten().tolist() for b in dl]
    assert tail == full[3:]
    assert sorted(ds.loaded) == sorted(i for b in full[3:] for i in b)  # the first 3 batches were never loaded
    assert len([b for b in dl]) == len(full)  # the next pass is a whole epoch again


def test_skip_first_batches_plain_dataloader() -> None:
    ds = CountingDataset(10)
    dl = DataLoader(ds, batch_size=3)
    skipped = accel.skip_first_batches(dl, 2)
    assert [b.flatten().tolist() for b in skipped] == [[6, 7, 8], [9]]
    assert ds.loaded == [6, 7, 8, 9]
    assert len(list(skipped)) == 4
    with pytest.raises(UsageError, match=">= 0"):
        accel.skip_first_batches(dl, -1)


def _batches(dl: Any, n: int | None = None) -> list[list[int]]:
    out = []
    for b in dl:
        out.append(b.flatten().tolist())
        if n is not None and len(out) == n:
            break
    return out


@pytest.mark.smoke
def test_dataloader_position_is_restored_mid_epoch(tmp_path: Path) -> None:
    def fresh() -> tuple[Kernel, Any]:
        torch.manual_seed(11)
        kernel = Kernel()
        return kernel, kernel.prepare(DataLoader(CountingDataset(30), batch_size=4, shuffle=True))

    kernel, dl = fresh()
    straight = _batches(dl) + _batches(dl)  # two epochs

    kernel, dl = fresh()
    it = iter(dl)
    seen = [next(it).flatten().tolist() for _ in range(5)]  # in the middle of epoch 0
    kernel.save_state(tmp_path / "mid")

    kernel, dl = fresh()
    torch.manual_seed(12345)  # a different sampler seed: the checkpoint must override it
    kernel.load_state(tmp_path / "mid")
    with pytest.raises(UsageError, match=r"skip_first_batches\(4\) disagrees with the checkpoint"):
        kernel.skip_first_batches(dl, 4)
    assert kernel.skip_first_batches(dl, 5) is dl  # the restored position, as Accelerate documents: no double skip
    resumed = seen + _batches(dl) + _batches(dl)
    assert resumed == straight


def test_dataloader_state_of_a_save_by_the_main_process_alone() -> None:
    """What save_state on the main process alone records of a prepared dataloader (Accelerate's save: the epoch and
    seed, not the position; accel.checkpoint.solo): the resumed pass starts the epoch again in the same order, and
    the script skips what it saw itself, by its own count (diffusers) or with skip_first_batches of any number."""

    def fresh() -> tuple[Kernel, Any]:
        torch.manual_seed(11)
        kernel = Kernel()
        return kernel, kernel.prepare(DataLoader(CountingDataset(30), batch_size=4, shuffle=True))

    kernel, dl = fresh()
    straight = _batches(dl) + _batches(dl)
    kernel, dl = fresh()
    it = iter(dl)
    seen = [next(it).flatten().tolist() for _ in range(5)]
    state = dl.pass_start_state()
    assert state["position"] == 0 and state["script_skips"]

    kernel, dl = fresh()
    torch.manual_seed(12345)
    dl.load_state_dict(state)
    assert _batches(dl) == straight[:8]  # the interrupted epoch again, from its start
    kernel, dl = fresh()
    dl.load_state_dict(state)
    assert kernel.skip_first_batches(dl, 5) is dl  # no restored position to disagree with
    assert seen + _batches(dl) + _batches(dl) == straight


def test_dataloader_after_a_finished_or_abandoned_pass(tmp_path: Path) -> None:
    def fresh() -> tuple[Kernel, Any]:
        torch.manual_seed(5)
        kernel = Kernel()
        return kernel, kernel.prepare(DataLoader(CountingDataset(12), batch_size=4, shuffle=True))

    kernel, dl = fresh()
    epochs = [_batches(dl) for _ in range(3)]

    kernel, dl = fresh()
    for i, _ in enumerate(dl):
        if i == 2:  # the last batch is out: saving here means "start the next epoch"
            kernel.save_state(tmp_path / "last")
    kernel, dl = fresh()
    kernel.load_state(tmp_path / "last")
    assert _batches(dl) == epochs[1]

    kernel, dl = fresh()
    _batches(dl, 1)  # a pass abandoned after one batch: the next pass replays the same epoch from its start
    kernel.save_state(tmp_path / "abandoned")
    kernel, dl = fresh()
    kernel.load_state(tmp_path / "abandoned")
    assert _batches(dl) == epochs[0]


@pytest.mark.smoke
def test_resume_mid_accumulation_restores_gradients(tmp_path: Path) -> None:
    def fresh() -> dict[str, Any]:
        return make_run(gradient_accumulation_steps=3)

    def steps(run: dict[str, Any], n: int, save_at: int | None = None) -> None:
        kernel, model, opt = run["kernel"], run["model"], run["opt"]
        for i, (x, y) in enumerate(run["dl"]):
            with kernel.accumulate(model):
                kernel.backward(((model(x) - y) ** 2).mean())
                opt.step()
                opt.zero_grad()
            if i + 1 == save_at:
                kernel.save_state(tmp_path / "acc")
                return
            if i + 1 == n:
                return

    a = fresh()
    steps(a, 10)
    b = fresh()
    steps(b, 10, save_at=5)  # micro-step 5 of accumulation 3: gradients of 2 micro-batches are pending
    c = fresh()
    c["kernel"].load_state(tmp_path / "acc")
    assert all(p.grad is not None for p in c["model"].parameters())
    c["kernel"].save_state(tmp_path / "again")  # saving right after loading keeps the pending gradients
    c = fresh()
    c["kernel"].load_state(tmp_path / "again")
    assert all(p.grad is not None for p in c["model"].parameters())
    steps(c, 5)
    assert all(torch.equal(v, params(a["model"])[k]) for k, v in params(c["model"]).items())


# ---- save_model ---------------------------------------------------------------------------------------------


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(8))


@pytest.mark.smoke
def test_save_model_sharded_with_tied_weights_loads_into_fresh_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    kernel = Kernel()
    model = kernel.prepare(TiedLM())
    files = kernel.save_model(model, tmp_path / "out", max_shard_size="2KB")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "model.safetensors.index.json" in names and len(names) > 2 and "model.safetensors" not in names
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["accel.aliases"] == {"head.weight": "embed.weight"}
    assert "head.weight" not in index["weight_map"] and len(files) == len(names)

    torch.manual_seed(1)
    fresh = TiedLM()
    accel.load_model(fresh, tmp_path / "out")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    assert fresh.head.weight is fresh.embed.weight

    # an untied model of the same shape gets the tied value in both places
    untied = TiedLM()
    untied.head.weight = nn.Parameter(torch.zeros(50, 16))
    accel.load_model(untied, tmp_path / "out")
    assert torch.equal(untied.head.weight, model.embed.weight)

    # saving again into one file removes the shards and the index
    kernel.save_model(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    from safetensors.torch import load_model as st_load_model

    other = TiedLM()
    st_load_model(other, tmp_path / "out" / "model.safetensors")  # safetensors' own loader accepts it too
    assert torch.equal(other.embed.weight, model.embed.weight)


def test_max_shard_size_parsing() -> None:
    from accel.checkpoint import parse_size

    assert parse_size("10GB") == 10 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("500kb") == 500_000
    assert parse_size(123) == 123
    with pytest.raises(UsageError, match="max_shard_size"):
        parse_size("lots")


@pytest.mark.smoke
def test_dcp_metadata_loads_with_the_restricted_unpickler(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata

    from accel.checkpoint import DCP_METADATA_GLOBALS, load_restricted_pickle

    with pytest.warns(UserWarning):  # "torch.distributed is ... uninitialized, assuming ... a single process"
        dcp.save(
            {"w": torch.randn(3, 4), "step": 3, "nested": {"b": torch.zeros(2, dtype=torch.bfloat16)}},
            checkpoint_id=tmp_path / "dcp",
        )
    metadata = load_restricted_pickle(tmp_path / "dcp" / ".metadata", DCP_METADATA_GLOBALS)
    assert isinstance(metadata, Metadata) and "w" in metadata.state_dict_metadata


def test_dataloader_and_optimizer_differences_are_refused(tmp_path: Path) -> None:
    def loader_run(n: int) -> tuple[Kernel, Any]:
        torch.manual_seed(0)
        kernel = Kernel()
        return kernel, kernel.prepare(DataLoader(CountingDataset(n), batch_size=4, shuffle=True))

    kernel, dl = loader_run(30)
    it = iter(dl)
    next(it)
    kernel.save_state(tmp_path / "dl")
    kernel, dl = loader_run(26)
    with pytest.raises(
        CheckpointError,
        match=r"'dataloader': the dataloader had 8 batches per process per epoch "
        r"when saved and has 7 now",
    ):
        kernel.load_state(tmp_path / "dl")

    run = make_run()
    run["kernel"].save_state(tmp_path / "opt")
    other = make_run()
    other["opt"].add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(
        CheckpointError,
        match=r"does not fit this optimizer: parameters per group \[4\] in the "
        r"checkpoint, \[4, 1\] in this run",
    ):
        other["kernel"].load_state(tmp_path / "opt")


def test_links_and_damaged_files_are_refused(tmp_path: Path) -> None:
    run = make_run()
    path = Path(run["kernel"].save_state(tmp_path / "ck"))
    (path / "kernel.json").rename(tmp_path / "kernel.json")
    with pytest.raises(CheckpointError, match="damaged: missing file"):
        run["kernel"].load_state(path)
    (path / "kernel.json").symlink_to(tmp_path / "kernel.json")
    with pytest.raises(CheckpointError, match="kernel.json has -1 bytes"):
        run["kernel"].load_state(path)
    (path / "kernel.json").unlink()
    (tmp_path / "kernel.json").rename(path / "kernel.json")
    with open(path / "model.safetensors", "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(CheckpointError, match="damaged: model.safetensors has"):
        run["kernel"].load_state(path)
