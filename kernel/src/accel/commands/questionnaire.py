"""The questionnaire of ``accel config``: the kernel's own questions, the plugins' ``accel_config_questions``,
the menus of backends whose plugin is not installed, and the askers (questionary with arrow keys, or a test's).

No torch import here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from accel.contract import QUESTION_KINDS, Question
from accel.errors import PluginError, UsageError
from accel.options import (
    KERNEL,
    Options,
    install_hint,
    known_plugins,
    providers_of,
    provides,
)
from accel.plugins import Plugins

#: Keys every written file has (Accelerate's ClusterConfig), with the kernel option's default when not answered.
STANDARD_KEYS = (
    "compute_environment",
    "distributed_type",
    "mixed_precision",
    "cpu",
    "debug",
    "num_processes",
    "num_machines",
    "machine_rank",
    "rdzv_backend",
    "same_network",
    "main_training_function",
    "enable_cpu_affinity",
)

#: Asks one question; ``disabled`` maps a choice value to the reason it cannot be chosen. Returns the raw answer.
Asker = Callable[[Question, Mapping[str, str]], Any]

NO_TERMINAL = (
    "`accel config` asks questions and needs a terminal, but {stream} is not one; write a config without "
    "questions with `accel config default [--mixed_precision bf16] [--config_file PATH]`, or pass flags "
    "to `accel launch` (see `accel launch --help`)"
)


def menu() -> dict[str, Any]:
    return known_plugins()["config_menu"]


# ---------------------------------------------------------------------------------------------------------------
# Availability of plugins and capabilities (install hints instead of choices)


def plugin_missing(plugins: Plugins, name: str | None) -> str | None:
    """``None`` when plugin ``name`` is usable (or no plugin is needed), else the reason with the install command."""
    if not name:
        return None
    rec = plugins.records.get(name)
    if rec is not None and rec.status == "loaded":
        return None
    if rec is not None:
        return f"plugin {name!r} is {rec.status}: {rec.reason}"
    hint = install_hint(name)
    return f"not installed: {hint}" if hint else f"needs the {name!r} plugin"


def capability_missing(plugins: Plugins, capability: str, unknown_may_provide: bool = True) -> str | None:
    """``None`` when an installed plugin may provide ``capability``, else the reason with the install command.
    Capabilities are known for published plugins only: an unknown installed plugin counts as a maybe in menus
    (the user decides), not in ``config default`` (which must write a config that works)."""
    known = known_plugins()["plugins"]
    loaded = plugins.loaded
    if any(provides(plugins.records[name].provides, capability) for name in loaded):
        return None  # declared by its component classes
    if any(name in known and provides(known[name]["provides"], capability) for name in loaded):
        return None
    if unknown_may_provide and any(name not in known and not plugins.records[name].provides for name in loaded):
        return None  # declares nothing: may provide anything
    for name in providers_of(capability):
        rec = plugins.records.get(name)
        if rec is not None:  # installed, but disabled or failed
            return f"plugin {name!r} is {rec.status}: {rec.reason}"
    hints = [install_hint(n) for n in providers_of(capability)]
    return "needs a plugin: " + " or ".join(hints) if hints else "no published plugin provides it"


# ---------------------------------------------------------------------------------------------------------------
# The questionnaire


class Questionnaire:
    """Asks the kernel's questions and the plugins' (``accel_config_questions``) and collects the answers by option
    name. ``ask`` does the talking (questionary on a terminal; tests may drive it through a pseudo-terminal)."""

    def __init__(self, plugins: Plugins, ask: Asker, env: Mapping[str, str] | None = None) -> None:
        self.plugins = plugins
        self.options: Options = plugins.options()
        self.ask = ask
        self.env = os.environ if env is None else env
        self.answers: dict[str, Any] = {}
        self.stored: list[str] = []  # option names answered, in order

    # ---- one question ----------------------------------------------------------------------------------

    def question(self, q: Question, disabled: Mapping[str, str] | None = None, owner: str = KERNEL) -> Any:
        """Ask ``q`` (unless already answered), check the answer with its option, record it, return it."""
        if q.key in self.answers:
            return self.answers[q.key]
        if q.kind not in QUESTION_KINDS:
            raise PluginError(f"plugin {owner!r}: question {q.key!r} has unknown kind {q.kind!r}")
        if q.titles and len(q.titles) != len(q.choices):
            raise PluginError(
                f"plugin {owner!r}: question {q.key!r} has {len(q.titles)} titles for {len(q.choices)} choices"
            )
        opt = self.options[q.key] if q.key in self.options else None
        if q.store and opt is None:
            raise PluginError(
                f"plugin {owner!r} asks about {q.key!r}, which no plugin declares as an option; declare "
                "it in accel_add_options or return the question with store=False"
            )
        if q.default is None and opt is not None and opt.default is not None:
            q = dataclasses.replace(q, default=opt.default)
        if q.kind == "select" and opt is not None and opt.choices and not q.choices:
            q = dataclasses.replace(q, choices=opt.choices)
        raw = self.ask(q, disabled or {})
        value = opt.coerce(raw, f"answer to {q.key!r}") if opt is not None else raw
        self.answers[q.key] = value
        if q.store:
            self.stored.append(q.key)
        return value

    def plugin_rounds(self) -> None:
        """Ask the plugins' questions one at a time: the first question (in plugin order) whose key has no answer
        yet, then ask every plugin again with that answer, until none returns an unanswered question."""
        for _ in range(1000):  # a plugin that keeps inventing keys must not loop forever
            for name, questions in self.plugins.call_each("accel_config_questions", answers=dict(self.answers)):
                for q in questions or ():
                    if not isinstance(q, Question):
                        raise PluginError(
                            f"plugin {name!r}: accel_config_questions must return accel.Question "
                            f"records, got {type(q).__name__}"
                        )
                pending = [q for q in questions or () if q.key not in self.answers]
                if pending:
                    self.question(pending[0], owner=name)
                    break
            else:
                return
        raise PluginError("accel_config_questions kept returning new questions after 1000 answers")

    # ---- the kernel's sections -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        hardware = self.plugins.detect_hardware(self.env)
        table = known_plugins()["distributed_type"]
        types = menu()["machine_types"]
        by_type = {t["distributed_type"]: t for t in types}

        # 1. The machine.
        machine = self.question(
            Question(
                "distributed_type",
                "Which type of machine are you using?",
                kind="select",
                choices=tuple(t["distributed_type"] for t in types),
                titles=tuple(t["title"] for t in types),
                default="NO",
            ),
            disabled={
                t["distributed_type"]: reason
                for t in types
                if (reason := plugin_missing(self.plugins, table.get(t["distributed_type"])))
            },
        )
        entry = by_type[machine]
        if entry.get("processes"):
            machines = self.question(
                Question(
                    "num_machines",
                    "How many different machines will you use (use more than 1 for multi-node training)?",
                    kind="int",
                    default=1,
                )
            )
            if machines > 1:
                self.question(
                    Question(
                        "machine_rank",
                        "What is the rank of this machine?",
                        kind="select",
                        choices=tuple(str(i) for i in range(machines)),
                        default="0",
                    )
                )
                self.question(
                    Question(
                        "main_process_ip",
                        "What is the IP address of the machine that will host the main process (or its host name)?",
                        kind="text",
                    )
                )
                self.question(
                    Question(
                        "main_process_port",
                        "What is the port you will use to communicate with the main process?",
                        kind="int",
                        default=29500,
                    )
                )
                same = self.question(
                    Question(
                        "same_network", "Are all the machines on the same local network?", kind="confirm", default=True
                    )
                )
                if not same:
                    self.question(
                        Question(
                            "rdzv_backend", "What rendezvous backend will you use?", kind="select", default="static"
                        )
                    )
            self.question(
                Question(
                    "debug",
                    "Should distributed operations be checked while running for errors? "
                    "This can avoid timeout issues but will be slower.",
                    kind="confirm",
                    default=False,
                )
            )
        if entry.get("cpu"):
            self.answers["cpu"] = True
            self.stored.append("cpu")
        elif machine == "NO":
            self.question(
                Question(
                    "cpu",
                    "Do you want to run your training on CPU only (even if a GPU is available)?",
                    kind="confirm",
                    default=hardware.name == "cpu",
                )
            )
        on_cpu = bool(self.answers.get("cpu"))
        if entry.get("strategies") and (entry.get("processes") or not on_cpu):
            # On the CPU: the strategies that run there (every one the menu marks "cpu"), for several processes.
            strategies = [s for s in menu()["strategies"] if s.get("cpu") or not on_cpu]
            plain = (
                "data parallel (a full copy of the model on each device)"
                if entry.get("processes")
                else "none (one process on one device)"
            )
            choice = self.question(
                Question(
                    "strategy",
                    "Which training strategy do you want to use?",
                    kind="select",
                    choices=(machine, *(s["distributed_type"] for s in strategies)),
                    titles=(plain, *(s["title"] for s in strategies)),
                    default=machine,
                    store=False,
                ),
                disabled={
                    s["distributed_type"]: reason
                    for s in strategies
                    if (reason := plugin_missing(self.plugins, table.get(s["distributed_type"])))
                },
            )
            self.answers["distributed_type"] = choice
        self.plugin_rounds()

        # 2. Compilation.
        compilers = self.options["dynamo_backend"].modes
        compile_missing = None if compilers and compilers.installed() else capability_missing(self.plugins, "compile")
        use = self.question(
            Question(
                "use_dynamo",
                "Do you wish to optimize your script with torch dynamo?",
                kind="select",
                choices=("no", "yes"),
                default="no",
                store=False,
            ),
            disabled={"yes": compile_missing} if compile_missing else {},
        )
        if use == "yes":
            backends = tuple(compilers.known()) if compilers else ()
            self.question(
                Question(
                    "dynamo_backend",
                    "Which dynamo backend would you like to use?",
                    kind="select",
                    choices=backends,
                    default=backends[0],
                ),
                disabled={b: reason for b in backends if (reason := capability_missing(self.plugins, f"compile:{b}"))},
            )
        else:
            self.answers.setdefault("dynamo_backend", "no")
        self.plugin_rounds()

        # 3. Processes, devices, precision.
        distributed = self.answers["distributed_type"]
        if entry.get("processes") or distributed != machine:
            per_machine = hardware.device_count if hardware.name != "cpu" and not self.answers.get("cpu") else 2
            self.question(
                Question(
                    "num_processes",
                    "How many processes should be used for distributed training, over all machines?",
                    kind="int",
                    default=max(1, per_machine) * int(self.answers.get("num_machines", 1)),
                )
            )
        if entry.get("devices") and not self.answers.get("cpu"):
            self.question(
                Question(
                    "gpu_ids",
                    "What GPU(s) (by id) should be used for training on this machine as a comma-separated list?",
                    kind="text",
                    default="all",
                )
            )
        precision = self.options["mixed_precision"].modes
        precisions = ("no", *(precision.known() if precision else ()))
        self.question(
            Question(
                "mixed_precision",
                "Do you wish to use mixed precision?",
                kind="select",
                choices=precisions,
                default="no",
            ),
            disabled={
                p: reason
                for p in precisions
                if p != "no"
                if (reason := capability_missing(self.plugins, f"precision:{p}"))
            },
        )
        self.plugin_rounds()
        return self.answers

    # ---- the file ------------------------------------------------------------------------------------

    def config_data(self) -> dict[str, Any]:
        values = {name: self.answers[name] for name in self.stored if name in self.answers}
        return build_config(self.options, values)


def build_config(options: Options, values: Mapping[str, Any]) -> dict[str, Any]:
    """The YAML mapping for ``values`` (by option name): the standard keys with their defaults, then every value
    at its option's config path. ``dynamo_backend: no`` is left out (Accelerate writes no dynamo_config then)."""
    data: dict[str, Any] = {}
    merged = {name: options[name].default for name in STANDARD_KEYS if name in options}
    merged.update(values)
    for name, value in merged.items():
        if name == "dynamo_backend" and str(value).lower() == "no":
            continue
        put(data, options[name].path, value)
    return data


def put(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


# ---------------------------------------------------------------------------------------------------------------
# questionary


def questionary_asker() -> Asker:
    import questionary

    def ask(q: Question, disabled: Mapping[str, str]) -> Any:
        if q.help:
            print(f"  {q.help}")
        if q.kind == "select":
            titles = q.titles or q.choices
            choices = [
                questionary.Choice(str(title), value=str(value), disabled=disabled.get(str(value)))
                for title, value in zip(titles, q.choices, strict=True)
            ]
            enabled = [c.value for c in choices if not c.disabled]
            if not enabled:
                raise UsageError(
                    f"no choice is available for {q.prompt!r}: " + "; ".join(f"{v}: {r}" for v, r in disabled.items())
                )
            default = str(q.default) if str(q.default) in enabled else enabled[0]
            return questionary.select(q.prompt, choices=choices, default=default).unsafe_ask()
        if q.kind == "confirm":
            return questionary.confirm(q.prompt, default=bool(q.default)).unsafe_ask()
        default = "" if q.default is None else str(q.default)
        if q.kind == "path":
            return questionary.path(q.prompt, default=default).unsafe_ask()
        return questionary.text(q.prompt, default=default, validate=validator(q)).unsafe_ask()

    return ask


def validator(q: Question) -> Callable[[str], bool | str]:
    def check(text: str) -> bool | str:
        if not text.strip():  # Enter on an offered default (even an empty one: "leave empty to ...") is an answer
            return "please enter a value" if q.default is None else True
        try:
            if q.kind == "int":
                int(text)
            elif q.kind == "float":
                float(text)
        except ValueError:
            return "please enter a whole number" if q.kind == "int" else "please enter a number"
        return True

    return check


def interactive_asker(ask: Asker, options: Options) -> Asker:
    """Re-ask a question whose answer its option refuses (out of range, not a choice), showing why."""

    def checked(q: Question, disabled: Mapping[str, str]) -> Any:
        while True:
            raw = ask(q, disabled)
            if q.key not in options:
                return raw
            try:
                options[q.key].coerce(raw, "answer")
                return raw
            except UsageError as exc:
                print(f"  {exc}; try again")

    return checked
