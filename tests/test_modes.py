"""Open modes and plugin-added hooks, with real plugin distributions installed by pip (tests/plugin_pkgs):

- accel-plugin-int8q declares ``precision:int8`` (int8 fake-quantised Linear weights in the forward): the new mode
  works as ``Kernel(mixed_precision="int8")``, the environment, a config file and ``accel launch --mixed_precision
  int8 -n 2``; a misspelt mode is one line naming the installed providers; without the plugin ``int8`` is unknown.
- accel-plugin-graphcount declares ``compile:graphcount``: ``dynamo_backend=graphcount`` compiles with it, also
  where accel-plugin-dynamo (``compile``: every backend) is installed.
- accel-plugin-shout adds a hook (``accel_hookspecs``) that accel-plugin-echo implements (registered first).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from clitools import clean_env, install, pythonpath, run

from accel import Kernel, UsageError
from accel.dispatch import PluginManager
from accel.plugins import Plugins, class_problem
from accel.spi import Component, hookimpl

FIXTURES = ("int8q", "graphcount", "shout", "echo")

SCRIPT = """
import torch
from accel import Kernel
from accel_int8q.precision import fake_int8

torch.manual_seed(0)
kernel = Kernel()
net = torch.nn.Linear(8, 4)
weight, bias = net.weight.detach().clone(), net.bias.detach().clone()
model = kernel.prepare(net)
x = torch.randn(5, 8)
out = model(x)
quantised = torch.equal(out, torch.nn.functional.linear(x, fake_int8(weight), bias))
changed = not torch.allclose(out, torch.nn.functional.linear(x, weight, bias))
print(f"RANK {kernel.process_index}/{kernel.num_processes} mode={kernel.mixed_precision} "
      f"quantised={quantised} changed={changed}", flush=True)
kernel.end_training()
"""


@pytest.fixture(scope="module")
def site() -> Path:
    return install(*FIXTURES)


@pytest.fixture
def installed(site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fixture plugins visible to this process's entry-point discovery (every plugin of this venv too)."""
    monkeypatch.syspath_prepend(str(site))
    for name in [n for n in os.environ if n.startswith(("ACCEL_", "ACCELERATE_"))]:
        monkeypatch.delenv(name)
    return site


class Net(torch.nn.Module):
    """A model whose code is not torch.nn's (``nn.Module.compile`` of a torch.nn class would run it uncompiled)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def component(kernel: Kernel, role: str) -> Component:
    (found,) = [c for c in kernel.components if c.role == role]
    return found


# ---- a precision mode of a plugin's own ----------------------------------------------------------------------


def test_new_precision_mode_changes_the_forward_only_inside_it(installed: Path) -> None:
    from accel_int8q.precision import Int8Precision, fake_int8

    torch.manual_seed(0)
    kernel = Kernel(mixed_precision="int8")
    assert kernel.mixed_precision == "int8" and isinstance(component(kernel, "precision"), Int8Precision)
    net = torch.nn.Linear(8, 4)
    model = kernel.prepare(net)
    x = torch.randn(5, 8)
    out = model(x)
    plain = torch.nn.functional.linear(x, net.weight, net.bias)  # outside the forward: not quantised
    assert torch.equal(out, torch.nn.functional.linear(x, fake_int8(net.weight), net.bias))
    assert not torch.allclose(out, plain)
    assert torch.equal(plain, x @ net.weight.T + net.bias)
    out.sum().backward()  # the gradient passes straight through to the full-precision weight
    assert net.weight.grad is not None and torch.allclose(net.weight.grad, x.sum(0).expand(4, 8))
    kernel.end_training()


def test_new_mode_from_the_environment_in_any_case(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "INT8")
    kernel = Kernel()
    assert (kernel.mixed_precision, kernel.settings.sources["mixed_precision"]) == ("int8", "env ACCEL_MIXED_PRECISION")
    kernel.end_training()


def test_misspelt_mode_names_the_installed_providers(installed: Path) -> None:
    with pytest.raises(UsageError) as err:
        Kernel(mixed_precision="int9")
    message = str(err.value)
    assert message.startswith(
        "Kernel(mixed_precision=...) must be no or a precision mode a plugin provides, got 'int9'"
    )
    assert "int8q: int8" in message and "amp: bf16, fp16, fp8" in message
    assert message.endswith("did you mean `int8`?") and "\n" not in message


def test_without_the_plugin_the_mode_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_DISABLE_PLUGINS", "int8q")
    with pytest.raises(UsageError, match=r"must be no or a precision mode a plugin provides, got 'int8' \(installed"):
        Kernel(mixed_precision="int8")


# ---- a compile backend of a plugin's own ---------------------------------------------------------------------


def test_compile_backend_of_a_plugin_wins_over_every_backend(installed: Path) -> None:
    from accel_graphcount.compiler import GraphCountCompiler

    kernel = Kernel(dynamo_backend="graphcount")  # accel-plugin-dynamo is installed too: it is not asked
    compiler = component(kernel, "compiler")
    assert isinstance(compiler, GraphCountCompiler) and compiler.graphs == 0
    net = Net()
    model = kernel.prepare(net)
    x = torch.randn(3, 8)
    assert torch.allclose(model(x), torch.relu(net.lin(x)))
    assert compiler.graphs == 1
    kernel.end_training()
    other = Kernel(dynamo_backend="eager")  # any other backend: dynamo's
    assert type(component(other, "compiler")).__name__ == "DynamoCompiler"
    other.end_training()


def test_misspelt_backend_without_dynamo_is_one_line(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_DISABLE_PLUGINS", "dynamo")
    with pytest.raises(UsageError) as err:
        Kernel(dynamo_backend="graphcnt")
    message = str(err.value)
    assert "must be no or a compile mode a plugin provides, got 'graphcnt'" in message
    assert "(installed providers: graphcount: graphcount)" in message  # dynamo is installed (disabled): no hint
    assert message.endswith("did you mean `graphcount`?")
    with pytest.raises(
        UsageError,
        match=r"needs a plugin that provides 'compile:inductor', .* plugin 'dynamo' is installed but disabled",
    ):
        Kernel(dynamo_backend="inductor")


# ---- hooks added by plugins ----------------------------------------------------------------------------------


def test_plugin_implements_a_hook_another_plugin_adds(installed: Path) -> None:
    plugins = Plugins.load()
    names = [r.name for r in plugins.all_records]
    assert names.index("echo") < names.index("shout")  # registered before the hook exists, checked after
    assert plugins.records["echo"].status == "loaded" and "accel_shout_words" in plugins.records["echo"].hooks
    kernel = Kernel(plugins=["shout", "echo"])
    kernel.prepare(torch.nn.Linear(2, 2))
    assert [c for c in kernel.components if c.name == "shout"][0].heard == ["echo", "Linear"]
    kernel.end_training()
    alone = Kernel(plugins=["shout"])  # nobody answers: an empty list
    alone.prepare(torch.nn.Linear(2, 2))
    assert [c for c in alone.components if c.name == "shout"][0].heard == []
    alone.end_training()


def test_optional_implementation_loads_without_the_hook_owner(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_DISABLE_PLUGINS", "shout")
    kernel = Kernel(plugins=["echo"])
    assert [c.name for c in kernel.components if c.role == "observer"] == ["echo"]
    kernel.end_training()


def test_implementation_of_an_absent_hook_is_refused_unless_optional(installed: Path) -> None:
    from accel_shout import hookspecs

    class Strict(Component):
        @hookimpl
        def accel_shout_words(self) -> list[str]:
            return []

    assert str(class_problem(Strict)).startswith("Strict implements unknown hook 'accel_shout_words'")
    with_spec = PluginManager()
    with_spec.add_hookspecs(hookspecs)
    assert class_problem(Strict, with_spec) is None


def test_bad_added_hooks_fail_only_their_plugin(installed: Path) -> None:
    """An ``accel_hookspecs`` entry that does not import fails its plugin; an implementation (registered before the
    spec existed) that the added spec finds invalid fails its own plugin, not the one adding the spec."""
    import types

    def module(name: str, **attributes: object) -> types.ModuleType:
        mod = types.ModuleType(name)
        for key, value in attributes.items():
            setattr(mod, key, hookimpl(value) if callable(value) else value)
        return mod

    def words(kernel: object, colour: object) -> list[str]:  # `colour` is not an argument of the spec
        return []

    plugins = Plugins.load(
        env={"ACCEL_PLUGINS": ""},
        extra=[
            ("b", module("b", accel_shout_words=words)),
            ("shout", module("shout", accel_hookspecs=["accel_shout.hookspecs"])),
            ("c", module("c", accel_hookspecs=["accel_nowhere.hookspecs"])),
        ],
    )
    status = {r.name: (r.status, r.reason) for r in plugins.all_records}
    assert status["shout"] == ("loaded", "")
    assert status["b"][0] == "failed" and "invalid hook implementation" in status["b"][1] and "colour" in status["b"][1]
    assert status["c"] == (
        "failed",
        "accel_hookspecs 'accel_nowhere.hookspecs': ModuleNotFoundError: No module named 'accel_nowhere'",
    )


def test_added_hooks_carry_their_plugins_name_and_a_string_is_not_a_list(installed: Path) -> None:
    """A hook added without its plugin's prefix (``my_custom_hook``) or with another plugin's (``accel_ddp_extra``),
    and ``accel_hookspecs = "pkg.specs"`` (a string, not a list), each fail their plugin with one line."""
    import sys
    import types

    from accel.spi import hookspec

    specs = types.ModuleType("accel_custom_specs")
    for name in ("my_custom_hook", "accel_ddp_extra"):
        setattr(specs, name, hookspec(lambda kernel: None))
    sys.modules["accel_custom_specs"] = specs
    try:
        plugins = Plugins.load(
            env={"ACCEL_PLUGINS": ""},
            extra=[
                ("custom", types.SimpleNamespace(accel_hookspecs=["accel_custom_specs"])),
                ("stringy", types.SimpleNamespace(accel_hookspecs="accel_shout.hookspecs")),
            ],
        )
    finally:
        del sys.modules["accel_custom_specs"]
    status = {r.name: (r.status, r.reason) for r in plugins.all_records}
    assert status["custom"] == (
        "failed",
        "accel_hookspecs 'accel_custom_specs': hook(s) accel_ddp_extra, my_custom_hook must be named "
        "accel_custom_<what> (a plugin's own hooks carry its name); rename accel_ddp_extra to accel_custom_ddp_extra",
    )
    assert status["stringy"] == (
        "failed",
        "accel_hookspecs must be a list of strings, got the string 'accel_shout.hookspecs'; write "
        "accel_hookspecs = ['accel_shout.hookspecs']",
    )


# ---- accel config's menus -----------------------------------------------------------------------------------


def test_config_menus_offer_the_modes_plugins_declare(installed: Path) -> None:
    from accel.commands.questionnaire import Questionnaire
    from accel.spi import Question

    answers = {"use_dynamo": "yes", "dynamo_backend": "graphcount", "mixed_precision": "int8"}
    offered: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {}

    def ask(q: Question, disabled: dict[str, str]) -> object:
        offered[q.key] = (q.choices, dict(disabled))
        return answers.get(q.key, q.default)

    plugins = Plugins.load(env={"ACCEL_PLUGINS": "ddp,amp,int8q,graphcount"})
    questionnaire = Questionnaire(plugins, ask, env={})
    questionnaire.run()
    backends, backend_disabled = offered["dynamo_backend"]
    assert backends[0] == "inductor" and "graphcount" in backends
    assert "graphcount" not in backend_disabled and "plugin 'dynamo' is disabled" in backend_disabled["inductor"]
    precisions, precision_disabled = offered["mixed_precision"]
    assert {"no", "int8", "fp16", "bf16", "fp8"} <= set(precisions) and "int8" not in precision_disabled
    data = questionnaire.config_data()
    assert data["mixed_precision"] == "int8" and data["dynamo_config"] == {"dynamo_backend": "graphcount"}


# ---- the command line ----------------------------------------------------------------------------------------


@pytest.fixture
def env(tmp_path: Path, site: Path) -> dict[str, str]:
    return clean_env(tmp_path, PYTHONPATH=pythonpath(site), COLUMNS="250")


def one_error(result, *needles: str) -> str:
    assert result.returncode == 2, result
    assert len(result.err_lines) == 1 and "Traceback" not in result.stderr, result
    for needle in needles:
        assert needle in result.err_lines[0], (needle, result.err_lines[0])
    return result.err_lines[0]


def test_launch_accepts_the_mode_from_flag_env_and_config_file(tmp_path: Path, env: dict[str, str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "int8.yaml"
    config.write_text("mixed_precision: int8\nnum_processes: 2\n")
    for args, extra in (
        (["--mixed_precision", "int8"], {}),
        (["--config_file", str(config)], {}),
        ([], {"ACCEL_MIXED_PRECISION": "int8"}),
    ):
        result = run(["launch", "--dry-run", *args, str(script)], {**env, **extra})
        assert result.returncode == 0, result
        assert "int8q (precision)" in result.stdout and "mixed_precision = 'int8'" in result.stdout, result
    assert "int8" in run(["launch", "--help"], env).stdout


def test_launch_refuses_a_misspelt_mode_naming_providers(tmp_path: Path, env: dict[str, str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    one_error(
        run(["launch", "--mixed_precision", "int9", str(script)], env),
        "`--mixed_precision` must be no or a precision mode a plugin provides, got 'int9'",
        "(installed providers: int8q: int8; more with pip install accel-plugin-fsdp (bf16), accel-plugin-deepspeed "
        "(bf16, fp16), accel-plugin-xla (bf16), accel-plugin-amp (bf16, fp16, fp8), ",
        "did you mean `int8`?",
    )
    bare = clean_env(tmp_path)  # the plugin is not installed: int8 is unknown
    one_error(
        run(["launch", "--mixed_precision", "int8", str(script)], bare),
        "got 'int8' (installed providers: none; more with",
    )
    one_error(  # a published mode keeps its install hint
        run(["launch", "--mixed_precision", "fp16", str(script)], bare),
        "needs a plugin that provides 'precision:fp16'",
        "pip install accel-plugin-amp",
    )
    one_error(
        run(["launch", "--dynamo_backend", "graphcnt", str(script)], env),
        "got 'graphcnt' (installed providers: graphcount: graphcount;",
        "did you mean `graphcount`?",
    )


@pytest.mark.slow
def test_new_mode_and_added_hook_on_two_processes(tmp_path: Path, env: dict[str, str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = ["launch", "--mixed_precision", "int8", "--plugin", "shout", "--plugin", "echo", "-n", "2", str(script)]
    result = run(args, env, cwd=tmp_path)
    assert result.returncode == 0, result
    for rank in (0, 1):
        assert f"RANK {rank}/2 mode=int8 quantised=True changed=True" in result.stdout, result
        assert f"[shout] ECHO LINEAR on process {rank}" in result.stdout, result


@pytest.mark.parametrize("args", [["--help"], ["launch", "--help"], ["plugins", "--json"]])
def test_modes_are_known_without_importing_torch(env: dict[str, str], args: list[str]) -> None:
    result = run(args, env, python_flags=("-X", "importtime"))
    assert result.returncode == 0, result
    imported = [
        line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    ]
    if args != ["--help"]:  # the plugins were loaded and their component classes read
        assert "accel_int8q.precision" in imported and "accel_graphcount.compiler" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
    if args == ["plugins", "--json"]:
        provides = {row["name"]: row["provides"] for row in json.loads(result.stdout)}
        assert provides["int8q"] == ["precision:int8"] and provides["graphcount"] == ["compile:graphcount"]
