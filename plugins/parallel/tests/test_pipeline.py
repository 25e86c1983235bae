"""accel-plugin-parallel, pipeline parallelism (``parallelism_config_pp_size``): real processes (gloo, CPU, torchrun on
free ports) train an MLP (a ``layers`` nn.Sequential, user tensor-parallel plan) and a tiny Qwen2 built from a config
(its Hugging Face tp_plan) with AdamW, gradient accumulation 2 and clipping at 1.0 (active: the Qwen2 norm reaches
1.14), on the same global batches as a 1-process run of the kernel alone (plugins/parallel/tests/pipeline_worker.py).

Every run also trains a tiny Qwen2 with tied input/output embeddings (``tie_word_embeddings=True``: its embedding
and head are on different processes, the Megatron way, see docs/parallelism.md), and evaluates each model: the loss of
the first batch and the accuracy of ``logits.argmax(-1)`` over all batches with ``gather_for_metrics``, which must
equal the one-process accuracy exactly (the logits differ from one process's by float32 rounding only, far below the
gap between the two largest logits).

Tolerances are those of plugins/parallel/tests/test_parallel.py (losses and clipping norms relative 1e-5, parameters absolute 1e-4,
checkpoints bitwise). Measured: losses and norms within 5e-7 relative; parameters within 8.3e-6 (Qwen2, pp=2 x tp=2),
3.5e-5 (tied Qwen2, pp=2 and pp=2 x tp=2; 2.4e-5 at pp=2 x dp_replicate=2), 4e-8 (MLP).

Sequence parallelism (``parallelism_config_tp_sequence_parallel``) runs on the decoders only (Qwen2 and a tiny
GPT-NeoX, clipping active: its norm reaches 1.75), dp_shard=2 x tp=2 and pp=2 x tp=2 (the latter from a
``megatron_lm_config`` with ``sequence_parallelism: true``). Measured: losses and norms within 4e-7 relative;
parameters within 5.9e-6 (Qwen2), 2.6e-5 (GPT-NeoX).

Launches (each process start costs seconds of ``import torch``/``transformers``): the 4-process runs of the plugin's
flags (the checkpoint's run, the resume from it, the other meshes) run one after the other in one launch (fixture
``four``: cases of ``test_parallel.launch_cases``, each its own Kernel, mesh, models, optimizers and loaders), the
2-process ones in another (``TWO``); the one-process load and the Megatron YAML start processes of their own.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_parallel import LOSS_TOL, PARAM_TOL, launch, launch_cases, mesh, run, sizes

from accel_parallel import MeshPlan
from accel_parallel.pipeline import split_layers, stage_ids

HERE = Path(__file__).parent
WORKER = HERE / "pipeline_worker.py"
ACCEL = str(Path(sys.executable).parent / "accel")
MODELS = ("mlp", "qwen2", "tied")  # tied: a Qwen2 with tie_word_embeddings=True
DECODERS = ("qwen2", "neox")  # the models sequence parallelism runs on (it needs a sequence dimension)

Result = tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]


def result(out: Path, suffix: str = "", models: tuple[str, ...] = MODELS) -> Result:
    return (
        json.loads((out / "result.json").read_text()),
        {k: load_file(str(out / f"{k}{suffix}.safetensors")) for k in models},
    )


def assert_matches(got: Result, ref: Result, models: tuple[str, ...] = MODELS) -> None:
    res, params = got
    ref_res, ref_params = ref
    for key in models:
        assert res["losses"][key] == pytest.approx(ref_res["losses"][key], rel=LOSS_TOL), key
        assert res["norms"][key] == pytest.approx(ref_res["norms"][key], rel=LOSS_TOL), key
        if key in res["eval_losses"]:
            assert res["eval_losses"][key] == pytest.approx(ref_res["eval_losses"][key], rel=LOSS_TOL), key
            # the eval loop's accuracy from the logits (argmax, gather_for_metrics) is the one-process accuracy
            assert res["accuracy"][key] == ref_res["accuracy"][key], key
        assert params[key].keys() == ref_params[key].keys()
        for name, value in ref_params[key].items():
            torch.testing.assert_close(params[key][name], value, rtol=0, atol=PARAM_TOL, msg=f"{key}.{name}")


def assert_bitwise(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    for key in a:
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name}"


def pp(n: int, size: int, *extra: str, **sizes: int) -> list[str]:
    return [*mesh(n, pp=size, **sizes), *extra]


# ---- no processes -------------------------------------------------------------------------------------------------


def test_layers_split_evenly_or_at_the_given_points() -> None:
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_layers(5, 2, [1]) == [(0, 1), (1, 5)]
    with pytest.raises(Exception, match="fewer than the 4 pipeline stages"):
        split_layers(3, 4)
    with pytest.raises(Exception, match="gives 2 split point"):
        split_layers(5, 2, [1, 2])
    with pytest.raises(Exception, match="increasing layer indices between 1 and 4"):
        split_layers(5, 2, [5])


def test_stages_of_each_schedule() -> None:
    assert [stage_ids(r, 2, "1f1b") for r in range(2)] == [[0], [1]]
    assert [stage_ids(r, 2, "interleaved1f1b") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids(r, 2, "zerobubble") for r in range(2)] == [[0, 3], [1, 2]]  # the V shape


def test_pp_is_the_outermost_mesh_dimension_and_reads_no_data_of_its_own() -> None:
    plan = MeshPlan((1, 2, 1, 1), pp=2)
    assert plan.world == 4 and plan.dims[0] == "pp"
    assert plan.groups("pp") == [[0, 2], [1, 3]]
    assert [plan.dp_index(r) for r in range(4)] == [0, 1, 0, 1]  # both stages of a pipeline read the same batch
    assert MeshPlan((1, 2, 1, 2)).describe()[0] == "mesh: dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 (4 processes)"


def test_dry_run_shows_the_stages_their_layers_and_ranks(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hello')\n")
    proc = run(
        [ACCEL, "launch", "--dry-run", *pp(4, 2, "--parallelism_config_pp_split_points", "model.layers.3", tp=2)]
        + ["train.py"],
        tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "mesh: pp=2 x dp_replicate=1 x dp_shard=1 x cp=1 x tp=2 (4 processes)" in out
    assert "  pp groups: [0,2] [1,3]" in out
    assert "  pipeline: 2 stages, schedule 1f1b" in out
    assert "    stage 0: layers from the first layer before model.layers.3; ranks [0,1]" in out
    assert "    stage 1: layers from model.layers.3 to the last layer; ranks [2,3]" in out
    proc = run([ACCEL, "launch", "--dry-run", *pp(2, 2, "--pp_microbatches", "4"), "train.py"], tmp_path, 120)
    assert proc.returncode == 0 and "parallelism_config_pp_microbatches = 4" in proc.stdout, proc.stderr


def test_sizes_that_do_not_match_the_processes_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hello')\n")
    proc = run([ACCEL, "launch", "--dry-run", *pp(4, 2), "train.py"], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accel: error")]
    assert len(lines) == 1 and "pp=2 x dp_replicate=1" in lines[0] and "--num_processes 2" in lines[0], proc.stderr


# ---- real processes -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """One process, kernel only (no plugin), the whole global batch each step."""
    tmp = tmp_path_factory.mktemp("ref")
    proc = run([sys.executable, str(WORKER), str(tmp / "out"), "--ref", "--models", "mlp,qwen2,tied,neox"], tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = result(tmp / "out", models=(*MODELS, "neox"))
    assert res[0]["world"] == 1 and res[0]["plugins"] == []
    return res


MESHES = {"pp2xdp2": {"pp": 2, "dp_shard": 2}, "pp4": {"pp": 4}, "pp2xdpr2": {"pp": 2, "dp_replicate": 2}}

#: the 4-process cases after the checkpoint's run and the resume from it (fixture ``four``): other meshes (Kernel
#: options) on the same processes
FOUR = [
    *((name, sizes(**mesh_sizes), []) for name, mesh_sizes in MESHES.items()),
    # pp=2 x tp=2 with sequence parallelism: test_an_accelerate_megatron_yaml_trains_on_four_processes
    ("sp", {**sizes(dp_shard=2, tp=2), "parallelism_config_tp_sequence_parallel": True}, ["--models", "qwen2,neox"]),
]

#: the 2-process cases (one launch, pp=2): each schedule, and user split points with evaluation without the logits
TWO = [
    *((s, {"parallelism_config_pp_schedule": s}, []) for s in ("gpipe", "interleaved1f1b")),
    # zerobubble: evaluation refused (torch 2.13's ScheduleZBVZeroBubble.eval fails), training checked
    ("zerobubble", {"parallelism_config_pp_schedule": "zerobubble"}, ["--no-eval"]),
    (
        "split",
        {"parallelism_config_pp_split_points": ["layers.1"], "parallelism_config_pp_eval_logits": False},
        ["--models", "mlp"],
    ),
]


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """4 processes (one launch, pp=2 x tp=2 from its flags), one case after the other: a checkpoint after batch 4
    of 6 (optimizer step 2 of 3); the resume from it (a new Kernel, models, optimizers and loaders); ``FOUR``."""
    tmp = tmp_path_factory.mktemp("four")
    ckpt = str(tmp / "out" / "pp2xtp2" / "ckpt")
    cases = [("pp2xtp2", {}, ["--save-at", "4"]), ("resume", {}, ["--save-at", "4", "--resume", ckpt]), *FOUR]
    return launch_cases(tmp, pp(4, 2, tp=2), WORKER, cases)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return launch_cases(tmp_path_factory.mktemp("two"), pp(2, 2), WORKER, TWO)


@pytest.fixture(scope="module")
def saved(four: Callable[[str], Path]) -> Path:
    """4 processes, pp=2 x tp=2, a checkpoint after batch 4 of 6 (optimizer step 2 of 3)."""
    return four("pp2xtp2")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp_2_x_tp_2_matches_one_process(saved: Path, reference: Result) -> None:
    res = result(saved)
    assert (res[0]["world"], res[0]["dp"]) == (4, 1)
    for key in MODELS:  # each process holds about a quarter of the parameters
        assert res[0]["local_numel"][key] <= 0.6 * reference[0]["local_numel"][key], key
    assert_matches(res, reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_on_the_same_pp_mesh_is_bitwise(saved: Path, four: Callable[[str], Path]) -> None:
    assert_bitwise(result(saved)[1], result(four("resume"))[1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_process_loads_a_pp_2_x_tp_2_checkpoint(saved: Path, tmp_path: Path) -> None:
    launch(tmp_path, *mesh(1), str(WORKER), str(tmp_path / "out"), "--load", str(saved / "ckpt"))
    assert_bitwise(result(saved, "_at_save")[1], result(tmp_path / "out", "_loaded")[1])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["pp2xdp2", "pp4", "pp2xdpr2"])
def test_four_processes_match_one_process(case: str, four: Callable[[str], Path], reference: Result) -> None:
    res = result(four(case))
    expected = {
        k.removeprefix("parallelism_config_").removesuffix("_size"): v for k, v in sizes(**MESHES[case]).items()
    }
    assert res[0]["world"] == 4 and res[0]["mesh"] == expected  # the case's mesh, not the launch's
    assert_matches(res, reference)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved1f1b", "zerobubble"])
def test_schedules_match_one_process(schedule: str, two: Callable[[str], Path], reference: Result) -> None:
    res = result(two(schedule))
    assert res[0]["schedule"] == schedule
    assert_matches(res, reference)
    assert bool(res[0]["eval_losses"]) != (schedule == "zerobubble")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_user_split_points_and_evaluation_without_logits(two: Callable[[str], Path], reference: Result) -> None:
    # and evaluation without the logits' broadcast: only the loss comes back (.logits is None)
    res = result(two("split"), models=("mlp",))
    assert res[0]["local_numel"]["mlp"] in (16 * 32 + 32, 2212 - (16 * 32 + 32))  # stage 0 holds layers.0 only
    assert res[0]["accuracy"] == {"mlp": None}
    res[0]["accuracy"] = reference[0]["accuracy"]
    assert_matches(res, reference, ("mlp",))


# ---- megatron_lm_config ---------------------------------------------------------------------------------------------

MEGATRON_YAML = (
    "compute_environment: LOCAL_MACHINE\ndistributed_type: MEGATRON_LM\nnum_processes: 4\nuse_cpu: true\n"
    "megatron_lm_config:\n  megatron_lm_tp_degree: 2\n  megatron_lm_pp_degree: 2\n"
    "  megatron_lm_num_micro_batches: 2\n  megatron_lm_gradient_clipping: 1.0\n"
    "  megatron_lm_sequence_parallelism: false\n  megatron_lm_use_distributed_optimizer: false\n"
)


MEGATRON_SP_YAML = MEGATRON_YAML.replace("sequence_parallelism: false", "sequence_parallelism: true")


def test_megatron_config_maps_to_the_mesh_with_one_notice(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hello')\n")
    (tmp_path / "c.yaml").write_text(MEGATRON_YAML)
    proc = run([ACCEL, "launch", "--dry-run", "--config_file", "c.yaml", "train.py"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "megatron_lm_config runs on torch-native" in line]
    assert len(notes) == 1 and "tp_size=2, pp_size=2, dp_shard_size=1, pp_microbatches=2" in notes[0], proc.stderr
    assert "gradient clipping at 1.0" in notes[0]
    assert "mesh: pp=2 x dp_replicate=1 x dp_shard=1 x cp=1 x tp=2 (4 processes)" in proc.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [("  megatron_lm_attention_backend: flash\n", "megatron_lm_attention_backend")],
)
def test_megatron_keys_without_a_torch_meaning_are_refused_by_name(tmp_path: Path, extra: str, message: str) -> None:
    (tmp_path / "train.py").write_text("print('hello')\n")
    (tmp_path / "c.yaml").write_text(MEGATRON_YAML.replace("  megatron_lm_sequence_parallelism: false\n", "") + extra)
    proc = run([ACCEL, "launch", "--dry-run", "--config_file", "c.yaml", "train.py"], tmp_path, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accel: error")]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_accelerate_megatron_yaml_trains_on_four_processes(reference: Result, tmp_path: Path) -> None:
    # pp=2 x tp=2 with sequence parallelism (megatron_lm_sequence_parallelism: true), on the two decoders
    (tmp_path / "c.yaml").write_text(MEGATRON_SP_YAML)
    args = ["--config_file", str(tmp_path / "c.yaml"), str(WORKER), str(tmp_path / "out"), "--models", "qwen2,neox"]
    launch(tmp_path, *args)
    res = result(tmp_path / "out", models=DECODERS)
    assert (res[0]["world"], res[0]["plugins"]) == (4, ["parallel"])
    assert res[0]["norm_seq"] == dict.fromkeys(DECODERS, 4)  # each norm ran on half of the 8-token sequences
    assert_matches(res, reference, DECODERS)  # the script clips at 1.0 too: the second clipping changes nothing


MEGATRON_AC_YAML = MEGATRON_YAML.replace(
    "  megatron_lm_gradient_clipping", "  megatron_lm_recompute_activations: true\n  megatron_lm_gradient_clipping"
)


def test_megatron_recompute_activations_maps_to_activation_checkpointing_on_any_mesh(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hello')\n")
    (tmp_path / "c.yaml").write_text(MEGATRON_AC_YAML)
    proc = run([ACCEL, "launch", "--dry-run", "--config_file", "c.yaml", "train.py"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr  # tp=2 x pp=2: no data-parallel dimension, no FSDP, accepted
    assert "activation_checkpointing=True" in proc.stderr
    bad = MEGATRON_YAML.replace("num_micro_batches: 2", "num_micro_batches: 0")
    (tmp_path / "c.yaml").write_text(bad)
    proc = run([ACCEL, "launch", "--dry-run", "--config_file", "c.yaml", "train.py"], tmp_path, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accel: error")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "`megatron_lm_config.megatron_lm_num_micro_batches` must be at least 1, got 0" in lines[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_activation_checkpointing_on_pp_2_x_tp_2_without_data_parallel_matches_one_process(
    reference: Result, tmp_path: Path
) -> None:
    # Megatron-LM's recompute_activations on tp=2 x pp=2: checkpointing without FSDP (no data-parallel dimension)
    (tmp_path / "c.yaml").write_text(MEGATRON_AC_YAML)
    launch(tmp_path, "--config_file", str(tmp_path / "c.yaml"), str(WORKER), str(tmp_path / "out"), "--models", "qwen2")
    res = result(tmp_path / "out", models=("qwen2",))
    assert (res[0]["world"], res[0]["dp"], res[0]["mesh"]["pp"], res[0]["mesh"]["tp"]) == (4, 1, 2, 2)
    assert res[0]["checkpointed"] == {"qwen2": 2}  # this process's 2 of the 4 decoder layers
    assert reference[0]["checkpointed"] == {"qwen2": 0, "mlp": 0, "tied": 0, "neox": 0}
    assert_matches(res, reference, ("qwen2",))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_activation_checkpointing_on_tp_2_alone_matches_one_process(reference: Result, tmp_path: Path) -> None:
    ac = ("--parallelism_config_activation_checkpointing", "true")
    launch(tmp_path, *mesh(2, tp=2), *ac, str(WORKER), str(tmp_path / "out"), "--models", "qwen2")
    res = result(tmp_path / "out", models=("qwen2",))
    assert (res[0]["world"], res[0]["mesh"]["tp"]) == (2, 2)
    assert res[0]["checkpointed"] == {"qwen2": 4}  # every decoder layer, tensor-parallel inside
    assert_matches(res, reference, ("qwen2",))


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ("layers.1,layers.1", "names layers.1 more than once"),
        ("layers.1", "gives 1 split point(s) (layers.1), but pp_size=3 with schedule 1f1b has 3 stages: give 2"),
    ],
)
def test_split_points_are_comma_separated_and_checked_before_launch(tmp_path: Path, points: str, message: str) -> None:
    (tmp_path / "train.py").write_text("print('hello')\n")
    good = run(
        [ACCEL, "launch", "--dry-run", *pp(3, 3, "--parallelism_config_pp_split_points", "layers.1,layers.3")]
        + ["train.py"],
        tmp_path,
        timeout=120,
    )
    assert good.returncode == 0, good.stderr
    assert "    stage 1: layers from layers.1 before layers.3; ranks [1]" in good.stdout
    proc = run(
        [ACCEL, "launch", "--dry-run", *pp(3, 3, "--parallelism_config_pp_split_points", points), "train.py"],
        tmp_path,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accel: error")]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def test_estimate_memory_rows_for_pp_count_the_busiest_stage() -> None:
    from accel.memory import MemoryQuery, ModelSummary, ParameterInfo
    from accel_parallel.memory import rows

    params = [ParameterInfo("embed.weight", (100, 10), True, "Embedding")]
    params += [ParameterInfo(f"model.layers.{i}.fc.weight", (10, 10), True, "Linear") for i in range(5)]
    params += [ParameterInfo("head.weight", (100, 10), True, "Linear")]
    model = ModelSummary("m", tuple(params), "embed", 1000)
    got = {r.options: r for r in rows(model, MemoryQuery(4, ("fp32",)))}
    # pp=2: layers 0-2 (the first stage takes the extra layer) and, as an upper bound, embedding and head
    assert got["pp=2, dp_shard=2, tp=1"].parameters == 4 * (1000 + 3 * 100 + 1000) // 2
    assert got["pp=4, dp_shard=1, tp=1"].parameters == 4 * (1000 + 2 * 100 + 1000)
    assert got["pp=4, dp_shard=1, tp=1"].optimizer == 2 * got["pp=4, dp_shard=1, tp=1"].parameters


# ---- sequence parallelism (Megatron-style, on the tp dimension) -----------------------------------------------------

SP = ("--parallelism_config_tp_sequence_parallel", "true")


def test_megatron_sequence_parallelism_maps_to_tp_sequence_parallel(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hello')\n")
    (tmp_path / "c.yaml").write_text(MEGATRON_SP_YAML)
    proc = run([ACCEL, "launch", "--dry-run", "--config_file", "c.yaml", "train.py"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tp_sequence_parallel=True" in proc.stderr
    assert "  tp: sequence parallel (norms and dropout on 1/tp of each sequence)" in proc.stdout
    proc = run([ACCEL, "launch", "--dry-run", *mesh(2, dp_shard=2), *SP, "train.py"], tmp_path, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accel: error")]
    assert proc.returncode == 2 and len(lines) == 1 and "but tp_size is 1" in lines[0], proc.stderr


def test_sequence_parallel_styles_shard_the_norms_and_split_the_embedding_output() -> None:
    from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from accel import UsageError
    from accel_parallel.strategy import sequence_parallel_styles, tp_plan

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    model = Qwen3ForCausalLM(config)
    names = [n for n, _ in model.named_modules()]
    # its Hugging Face plan without the embedding (left whole here) and the q/k norms (a style accel lacks)
    plan = {k: v for k, v in tp_plan(model, None).items() if not k.endswith(("_norm", "embed_tokens"))}
    planned = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in plan)]
    styles = sequence_parallel_styles(model, planned)
    norms = {"model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm"}
    assert {n for n, s in styles.items() if isinstance(s, SequenceParallel)} == norms  # not q_norm: local heads
    assert isinstance(styles.pop("model.embed_tokens"), PrepareModuleOutput) and styles.keys() == norms
    with pytest.raises(UsageError, match="does not include its LM head 'lm_head'"):
        sequence_parallel_styles(model, [n for n in planned if n != "lm_head"])
    from pipeline_worker import MLP

    with pytest.raises(UsageError, match="is not a Hugging Face decoder"):
        sequence_parallel_styles(MLP(), ["layers.0.0"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sequence_parallel_dp_shard_2_x_tp_2_matches_one_process(
    four: Callable[[str], Path], reference: Result
) -> None:
    # pp=2 x tp=2 with sequence parallelism: test_an_accelerate_megatron_yaml_trains_on_four_processes
    res = result(four("sp"), models=DECODERS)
    assert res[0]["norm_seq"] == dict.fromkeys(DECODERS, 4)  # each norm ran on half of the 8-token sequences
    assert_matches(res, reference, DECODERS)
