"""accel.options: the one schema behind launch flags, config-file keys, environment variables and Kernel arguments.
The kernel's own schema (``core_options``), how ``resolve`` merges the sources (Kernel arguments, flags, what
``accel launch`` hands over, environment variables, the config file, defaults: highest first) and records where each
value came from, and that a bad value is one line naming where it came from, whatever the source. No plugin is
loaded: every option here is the kernel's or one these tests declare."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from accel.config_files import read_config_file, validate_config
from accel.errors import PluginError, UsageError
from accel.options import (
    TYPES,
    Options,
    Settings,
    check_device_ids,
    check_host,
    core_options,
    int_env,
    resolve,
    split_list,
)


def kernel_options() -> Options:
    options = Options(declared={})  # plugins loaded, none installed: mode values are checked against published ones
    core_options(options)
    return options


def widget_options() -> Options:
    """A small schema: one option per source the tests set, read from two variables (the first found wins)."""
    options = Options()
    options.current_plugin = "widgets"
    options.add("widget_size", type="int", default=3, minimum=1, env=("ACCEL_WIDGET_SIZE", "WIDGET_SIZE"))
    options.add("widget_mode", default="fast", choices=("fast", "slow"), config_key="widget_config.mode")
    options.add("widget_extra", type="mapping", default={}, fields="widget_")
    return options


# ---- the schema ----------------------------------------------------------------------------------------------------


def test_the_kernels_schema_is_consistent() -> None:
    """Every core option has a known type, a help text, a default its own check accepts, and its own config path,
    flag spellings and variables (one setting per surface)."""
    options = kernel_options()
    opts = list(options)
    assert {"num_processes", "mixed_precision", "gradient_accumulation_steps", "plugins"} <= {o.name for o in opts}
    assert all(o.type in TYPES and o.help and o.plugin == "accel" for o in opts)
    assert len(options.by_path()) == len(opts)  # no two options share a config key
    flags = [f for o in opts for f in (f"--{o.name}", *o.flags)]
    assert len(flags) == len(set(flags))
    variables = [v for o in opts for v in o.env]
    assert len(variables) == len(set(variables))
    for opt in opts:
        if opt.default is not None:
            assert opt.coerce(opt.default, f"default of {opt.name}") == opt.default, opt.name


def test_config_keys_and_flags_come_from_the_declaration() -> None:
    options = kernel_options()
    assert options["cpu"].path == ("use_cpu",) and options["dynamo_backend"].dotted == "dynamo_config.dynamo_backend"
    assert options.by_path()[("dynamo_config", "dynamo_backend")].name == "dynamo_backend"
    assert options["num_processes"].flags == ("-n",) and options["plugins"].flags == ("--plugin",)
    assert options.defaults()["num_processes"] == 1 and options.defaults()["mixed_precision"] == "no"


def test_an_option_declared_twice_names_both_plugins() -> None:
    options = widget_options()
    options.current_plugin = "gadgets"
    with pytest.raises(PluginError, match=r"option `widget_size` is declared by both 'widgets' and 'gadgets'"):
        options.add("widget_size", type="int")
    with pytest.raises(PluginError, match=r"plugin 'gadgets' declares option 'gadget' with unknown type 'integer'"):
        options.add("gadget", type="integer")
    options.remove_plugin("widgets")
    assert "widget_size" not in options and list(options) == []


# ---- precedence ------------------------------------------------------------------------------------------------------

#: One value per source, highest precedence first, and the source ``resolve`` records for it.
SOURCES: list[tuple[str, str, int]] = [
    ("kwargs", "argument", 6),
    ("flags", "flag", 5),
    ("launched", "launch", 4),
    ("env", "env ACCEL_WIDGET_SIZE", 3),
    ("config", "file", 2),
]


@pytest.mark.parametrize("given", range(len(SOURCES) + 1), ids=[s for s, _, _ in SOURCES] + ["default"])
def test_the_highest_source_given_wins(given: int) -> None:
    """Every source from ``given`` down is set: the highest of them wins and is recorded as the source."""
    sources: dict[str, Any] = {}
    for name, _, value in SOURCES[given:]:
        sources[name] = {"ACCEL_WIDGET_SIZE": str(value)} if name == "env" else {"widget_size": value}
    values, where = resolve(widget_options(), **sources)
    expected = (SOURCES[given][2], SOURCES[given][1]) if given < len(SOURCES) else (3, "default")
    assert (values["widget_size"], where["widget_size"]) == expected
    assert (values["widget_mode"], where["widget_mode"]) == ("fast", "default")


def test_environment_variables_first_found_wins_and_empty_is_unset() -> None:
    options = widget_options()
    values, where = resolve(options, env={"WIDGET_SIZE": "7", "ACCEL_WIDGET_SIZE": "8"})
    assert (values["widget_size"], where["widget_size"]) == (8, "env ACCEL_WIDGET_SIZE")
    values, where = resolve(options, env={"WIDGET_SIZE": "7", "ACCEL_WIDGET_SIZE": ""})
    assert (values["widget_size"], where["widget_size"]) == (7, "env WIDGET_SIZE")
    values, where = resolve(options, env={"ACCEL_WIDGET_SIZE": ""}, config={"widget_size": 5})
    assert (values["widget_size"], where["widget_size"]) == (5, "file")


def test_none_from_a_flag_or_argument_means_not_given() -> None:
    values, where = resolve(widget_options(), config={"widget_size": 5}, flags={"widget_size": None}, kwargs={})
    assert (values["widget_size"], where["widget_size"]) == (5, "file")


def test_values_are_converted_whatever_the_source() -> None:
    options = kernel_options()
    values, _ = resolve(
        options,
        flags={"num_processes": "4", "same_network": "false", "plugins": ["a,b", "c"]},
        env={"ACCELERATE_MIXED_PRECISION": "BF16", "ACCEL_USE_CPU": "yes"},
        kwargs={"monitor_interval": "2.5"},
    )
    assert values["num_processes"] == 4 and values["same_network"] is False and values["plugins"] == ["a", "b", "c"]
    assert values["mixed_precision"] == "bf16" and values["cpu"] is True and values["monitor_interval"] == 2.5


def test_mapping_fields_are_checked_by_their_own_options() -> None:
    values, _ = resolve(widget_options(), kwargs={"widget_extra": {"size": "4", "colour": "red"}})
    assert values["widget_extra"] == {"size": 4, "colour": "red"}
    with pytest.raises(UsageError) as info:
        resolve(widget_options(), config={"widget_extra": {"size": 0}})
    assert str(info.value) == "config key widget_extra field 'size' must be at least 1, got 0"
    with pytest.raises(UsageError) as info:
        resolve(widget_options(), kwargs={"widget_extra": '{"mode": "medium"}'})
    assert str(info.value) == "Kernel(widget_extra={'mode': ...}) must be one of fast, slow, got 'medium'"


# ---- bad values: one line naming where the value came from ------------------------------------------------------------


@pytest.mark.parametrize(
    "source, label",
    [
        ({"kwargs": {"widget_size": "two"}}, "Kernel(widget_size=...)"),
        ({"flags": {"widget_size": "two"}}, "`--widget_size`"),
        ({"launched": {"widget_size": "two"}}, "ACCEL_CONFIG"),
        ({"env": {"WIDGET_SIZE": "two"}}, "environment variable WIDGET_SIZE"),
    ],
    ids=["argument", "flag", "launch", "env"],
)
def test_a_bad_value_is_one_line_naming_its_source(source: dict[str, Any], label: str) -> None:
    with pytest.raises(UsageError) as info:
        resolve(widget_options(), **source)
    assert str(info.value) == f"{label} expects a whole number, got 'two'"


def read(path: Path, options: Options) -> dict[str, Any]:
    """A config file as the launcher and the Kernel read it: parsed, then checked against the schema by its keys."""
    values, notes = validate_config(read_config_file(path), options, loaded=[], where=f"config file {path.name}")
    assert notes == []
    return values


def test_a_real_config_file_sits_between_the_environment_and_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("gradient_accumulation_steps: 2\nuse_cpu: true\nmixed_precision: 'no'\n")
    options = kernel_options()
    config = read(tmp_path / "config.yaml", options)
    assert config == {"gradient_accumulation_steps": 2, "cpu": True, "mixed_precision": "no"}
    steps = "ACCEL_GRADIENT_ACCUMULATION_STEPS"
    for env, kwargs, expected in [
        ({}, {}, (2, "file")),
        ({steps: "3"}, {}, (3, f"env {steps}")),
        ({steps: "3"}, {"gradient_accumulation_steps": 4}, (4, "argument")),
    ]:
        values, where = resolve(options, config=config, env=env, kwargs=kwargs)
        assert (values["gradient_accumulation_steps"], where["gradient_accumulation_steps"]) == expected
        assert (values["cpu"], where["cpu"]) == (True, "file") and where["num_processes"] == "default"


def test_a_bad_value_in_the_config_file_names_its_key(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("widget_config:\n  mode: sloww\n")
    with pytest.raises(UsageError) as info:
        read(tmp_path / "config.yaml", widget_options())
    assert str(info.value) == (
        "config file config.yaml: `widget_config.mode` must be one of fast, slow, got 'sloww'; did you mean `slow`?"
    )


@pytest.mark.parametrize(
    "name, raw, message",
    [
        ("same_network", "maybe", "expects true or false, got 'maybe'"),
        ("num_processes", True, "expects a whole number, got True"),
        ("num_processes", "0", "must be at least 1, got '0'"),
        ("num_processes", 2**18 + 1, "must be at most 262144, got 262145"),
        ("monitor_interval", "soon", "expects a number, got 'soon'"),
        ("rdzv_backend", "c10", "must be one of static, c10d, etcd, etcd-v2, got 'c10'; did you mean `c10d`?"),
        ("main_process_ip", "10.0.0.300.1.x_y", "must be an IP address (10.0.0.7) or a host name (node-1.example.com)"),
        ("gpu_ids", "0,0", "lists a device twice, got '0,0'"),
        ("mixed_precision", "fp17", "must be no or a precision mode a plugin provides, got 'fp17'"),
    ],
)
def test_each_kind_of_bad_value_is_one_line(name: str, raw: Any, message: str) -> None:
    with pytest.raises(UsageError) as info:
        resolve(kernel_options(), flags={name: raw})
    text = str(info.value)
    assert text.startswith(f"`--{name}` ") and message in text and "\n" not in text, text


def test_accepted_spellings() -> None:
    options = kernel_options()
    assert [options["same_network"].coerce(w, "x") for w in ("Yes", "on", "1", "no", "OFF", "0", "")] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    assert options["rdzv_backend"].coerce("C10D", "x") == "c10d"  # folded to the declared spelling
    assert options["mixed_precision"].coerce(False, "x") == "no"  # YAML 1.1 reads an unquoted `no` as False
    assert split_list(["a, b", "", "c", 3]) == ["a", "b", "c", 3]
    assert check_host("node-1.example.com") is None and check_host("::1") is None and check_host("") is None
    assert check_device_ids("all") is None and check_device_ids("0,2") is None
    assert check_device_ids("0;1") == "must be 'all' or device numbers separated by commas (0,1,3)"


def test_int_env_names_the_variable() -> None:
    assert int_env({"WORLD_SIZE": " "}, "WORLD_SIZE", 1) == 1 and int_env({"WORLD_SIZE": "4"}, "WORLD_SIZE", 1) == 4
    with pytest.raises(UsageError, match=r"^environment variable WORLD_SIZE must be a whole number, got 'two'; "):
        int_env({"WORLD_SIZE": "two"}, "WORLD_SIZE", 1)


def test_settings_select_plugins_by_name_or_by_accelerates_distributed_type() -> None:
    values, sources = resolve(kernel_options(), config={"distributed_type": "MULTI_CPU"}, env={})
    assert Settings(values, sources).selected == ("ddp",)  # Accelerate's MULTI_CPU: the ddp plugin, by its name
    assert Settings({"distributed_type": "NO"}).selected == () and Settings({}).selected == ()
    assert Settings({"distributed_type": "MULTI_CPU", "plugins": ["fsdp"]}).selected == ("fsdp",)
    settings = Settings({"plugins": ["amp"]})
    assert settings.is_selected("amp") and not settings.is_selected("ddp") and settings.mixed_precision == "no"
