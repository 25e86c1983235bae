"""accel.commands.questionnaire with the kernel alone (``ACCEL_PLUGINS=""``): the questions ``accel config`` asks,
driven by a scripted asker; machine types and modes that need a missing plugin are offered disabled with the reason
(the plugin and how to get it); every answer is checked by its option, and a bad one is one line; the file written
has the standard keys and each answer at its option's config path. The plugins' own questions are in
tests/test_config_questions_hook.py, the real terminal in tests/test_config_command.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from accel import Question
from accel.commands.questionnaire import Questionnaire, build_config, capability_missing, plugin_missing
from accel.errors import PluginError, UsageError
from accel.options import providers_of
from accel.plugins import Plugins


class Script:
    """Answers by key (else the question's default) and records what was asked and what was disabled."""

    def __init__(self, answers: Mapping[str, Any] | None = None) -> None:
        self.answers = dict(answers or {})
        self.asked: list[str] = []
        self.disabled: dict[str, dict[str, str]] = {}

    def __call__(self, q: Question, disabled: Mapping[str, str]) -> Any:
        self.asked.append(q.key)
        self.disabled[q.key] = dict(disabled)
        return self.answers.get(q.key, q.default)


@pytest.fixture
def alone() -> Plugins:
    return Plugins.load(env={"ACCEL_PLUGINS": ""})


def test_the_kernel_alone_offers_one_process_and_says_what_the_others_need(alone: Plugins) -> None:
    script = Script()
    questionnaire = Questionnaire(alone, script, env={})
    questionnaire.run()
    assert script.asked[0] == "distributed_type"
    disabled = script.disabled["distributed_type"]
    assert "NO" not in disabled and "MULTI_CPU" in disabled and "ddp" in disabled["MULTI_CPU"]
    data = questionnaire.config_data()
    assert (data["distributed_type"], data["num_processes"], data["mixed_precision"]) == ("NO", 1, "no")
    assert "dynamo_config" not in data  # `dynamo_backend: no` is left out, as Accelerate writes it


def test_an_answer_is_checked_by_its_option(alone: Plugins) -> None:
    questionnaire = Questionnaire(alone, Script({"num_processes": "0"}), env={})
    with pytest.raises(UsageError) as info:
        questionnaire.question(Question("num_processes", "How many processes?", kind="int"))
    assert str(info.value) == "answer to 'num_processes' must be at least 1, got '0'"
    assert questionnaire.question(Question("same_network", "Same network?", kind="confirm")) is True  # its default


def test_a_malformed_question_names_its_plugin(alone: Plugins) -> None:
    questionnaire = Questionnaire(alone, Script(), env={})
    with pytest.raises(PluginError, match=r"^plugin 'mine': question 'x' has unknown kind 'slider'$"):
        questionnaire.question(Question("x", "?", kind="slider"), owner="mine")
    with pytest.raises(PluginError, match=r"^plugin 'mine' asks about 'widget', which no plugin declares"):
        questionnaire.question(Question("widget", "?", kind="confirm"), owner="mine")


def test_the_file_has_the_standard_keys_and_each_answer_at_its_path(alone: Plugins) -> None:
    options = alone.options()
    data = build_config(options, {"cpu": True, "dynamo_backend": "inductor", "num_processes": 2})
    assert data["use_cpu"] is True and data["num_processes"] == 2
    assert data["dynamo_config"] == {"dynamo_backend": "inductor"}
    assert {"distributed_type", "mixed_precision", "num_machines"} <= set(data)
    assert "dynamo_config" not in build_config(options, {"dynamo_backend": "no"})


def test_missing_plugins_and_capabilities_say_how_to_get_them(alone: Plugins) -> None:
    assert plugin_missing(alone, None) is None
    ddp = plugin_missing(alone, "ddp")  # installed here but left out by ACCEL_PLUGINS; in a bare venv not installed
    assert ddp in ("not installed: pip install accel-plugin-ddp", "plugin 'ddp' is disabled: not in ACCEL_PLUGINS")
    assert plugin_missing(alone, "nosuchplugin") == "needs the 'nosuchplugin' plugin"
    bf16 = capability_missing(alone, "precision:bf16")  # a provider installed but disabled, or the ones to install
    assert bf16 is not None and any(name in bf16 for name in providers_of("precision:bf16")), bf16
    assert capability_missing(alone, "precision:fp3") == "no published plugin provides it"
