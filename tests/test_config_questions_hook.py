"""The `accel_config_questions` hook: how plugin questions are asked, in which order, and what is written.

These drive the real Questionnaire and plugin manager with small plugins registered directly; the answers come from
a scripted asker (the real prompts are driven through a pseudo-terminal in test_config_command.py)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import pytest

from accel import Options, PluginError, Question, hookimpl
from accel.commands.questionnaire import Questionnaire
from accel.plugins import Plugins
from accel.testing.shadow import hide_plugins


@pytest.fixture(autouse=True)
def only_ddp_installed(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide every published plugin but ddp from discovery (whatever this venv has installed)."""
    monkeypatch.syspath_prepend(str(hide_plugins(tmp_path / "shadow", keep=("ddp",))))


class Script:
    """Answers questions by key and records what was asked (key, disabled choices)."""

    def __init__(self, answers: Mapping[str, Any]) -> None:
        self.answers = dict(answers)
        self.asked: list[str] = []
        self.disabled: dict[str, Mapping[str, str]] = {}

    def __call__(self, q: Question, disabled: Mapping[str, str]) -> Any:
        self.asked.append(q.key)
        self.disabled[q.key] = dict(disabled)
        if q.key in self.answers:
            return self.answers[q.key]
        return q.default


def module(name: str, **hooks: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for hook, fn in hooks.items():
        setattr(mod, hook, hookimpl(fn))
    return mod


def widgets() -> types.ModuleType:
    """A plugin with a follow-up question (size only when enabled) and a flow-only question."""

    def accel_add_options(options: Options) -> None:
        options.add("widget_enabled", type="bool", default=False, config_key="widget_config.enabled")
        options.add("widget_size", type="int", default=3, minimum=1, config_key="widget_config.size")

    def accel_config_questions(answers: Mapping[str, Any]) -> list[Question] | None:
        if answers.get("distributed_type") != "MULTI_CPU":
            return None
        qs = [Question("widget_enabled", "Use widgets?", kind="confirm")]
        if answers.get("widget_enabled"):
            qs.append(Question("widget_size_known", "Do you know the size?", kind="confirm", store=False))
            if answers.get("widget_size_known"):
                qs.append(Question("widget_size", "Widget size?", kind="int"))
        qs.append(Question("widget_done", "Done?", kind="confirm", default=True, store=False))
        return qs

    return module("widgets", accel_add_options=accel_add_options, accel_config_questions=accel_config_questions)


def run(answers: Mapping[str, Any], *extra: tuple[str, Any]) -> tuple[Questionnaire, Script]:
    plugins = Plugins.load(env={"ACCEL_PLUGINS": "ddp"}, extra=extra)
    script = Script(answers)
    questionnaire = Questionnaire(plugins, script, env={})
    questionnaire.run()
    return questionnaire, script


def test_plugin_questions_follow_their_answers_in_order() -> None:
    q, script = run(
        {
            "distributed_type": "MULTI_CPU",
            "widget_enabled": True,
            "widget_size_known": True,
            "widget_size": "7",
            "num_processes": "2",
        },
        ("widgets", widgets()),
    )
    # the follow-ups come right after the answer they depend on, before the plugin's next question
    i = script.asked.index("widget_enabled")
    assert script.asked[i : i + 4] == ["widget_enabled", "widget_size_known", "widget_size", "widget_done"]
    # asked after the kernel's machine section and before its compile section
    assert script.asked.index("debug") < i < script.asked.index("use_dynamo")
    data = q.config_data()
    assert data["widget_config"] == {"enabled": True, "size": 7}  # checked by the option: "7" -> 7
    assert "widget_size_known" not in str(data) and "widget_done" not in str(data)  # store=False: flow only
    assert data["distributed_type"] == "MULTI_CPU" and data["num_processes"] == 2 and data["use_cpu"] is True


def test_plugin_questions_are_skipped_when_not_selected() -> None:
    _, script = run(
        {"distributed_type": "MULTI_CPU", "widget_enabled": False, "num_processes": "2"}, ("widgets", widgets())
    )
    assert "widget_size_known" not in script.asked and "widget_size" not in script.asked
    _, script = run({"distributed_type": "NO", "cpu": True}, ("widgets", widgets()))
    assert not any(k.startswith("widget") for k in script.asked)


def test_a_question_about_an_undeclared_option_names_the_plugin() -> None:
    bad = module("bad", accel_config_questions=lambda answers: [Question("no_such_option", "?", kind="confirm")])
    with pytest.raises(PluginError, match="plugin 'bad' asks about 'no_such_option'.*store=False"):
        run({"distributed_type": "NO", "cpu": True}, ("bad", bad))


def test_a_wrong_answer_type_names_the_plugin() -> None:
    bad = module("bad2", accel_config_questions=lambda answers: ["not a question"])
    with pytest.raises(PluginError, match="plugin 'bad2'.*Question"):
        run({"distributed_type": "NO", "cpu": True}, ("bad2", bad))


def test_missing_backends_are_disabled_with_install_hints() -> None:
    q, script = run({"distributed_type": "MULTI_GPU", "num_processes": "2"})
    machine = script.disabled["distributed_type"]
    assert machine == {"XLA": "not installed: pip install accel-plugin-xla"}  # ddp is installed: multi-* offered
    assert script.disabled["strategy"] == {
        "DEEPSPEED": "not installed: pip install accel-plugin-deepspeed",
        "FSDP": "not installed: pip install accel-plugin-fsdp",
    }
    assert "pip install accel-plugin-dynamo" in script.disabled["use_dynamo"]["yes"]
    assert set(script.disabled["mixed_precision"]) == {"fp16", "bf16", "fp8"}


def test_with_the_ddp_plugin_disabled_multi_process_machines_are_not_offered() -> None:
    plugins = Plugins.load(env={"ACCEL_DISABLE_PLUGINS": "ddp"})
    script = Script({"distributed_type": "NO", "cpu": True})
    Questionnaire(plugins, script, env={}).run()
    reason = "plugin 'ddp' is disabled: disabled by ACCEL_DISABLE_PLUGINS"
    assert script.disabled["distributed_type"]["MULTI_CPU"] == reason
    assert script.disabled["distributed_type"]["MULTI_GPU"] == reason
