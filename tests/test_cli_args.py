"""The flag value types every kvgate command shares: bad values are argparse errors (exit 2)."""

from __future__ import annotations

import argparse

import pytest

from kvgate.api.cli_args import (
    REQUEST_TEMPLATE_LIMITS_HELP,
    SimTiming,
    add_simulation_group,
    boolean,
    non_negative_float,
    port,
    positive_float,
    positive_int,
)


@pytest.mark.parametrize(("text", "value"), [("true", True), ("On", True), ("0", False), ("no", False)])
def test_boolean(text: str, value: bool) -> None:
    assert boolean(text) is value


@pytest.mark.parametrize(
    ("fn", "text", "message"),
    [
        (boolean, "maybe", "expected true or false"),
        (port, "http", "expected a port number"),
        (port, "65536", "port must be in 0..65535"),
        (port, "-1", "port must be in 0..65535"),
        (positive_int, "0", "must be at least 1"),
        (positive_int, "1.5", "expected an integer"),
        (non_negative_float, "-0.1", "must not be negative"),
        (non_negative_float, "fast", "expected a number"),
        (positive_float, "0", "must be positive"),
        (positive_float, "x", "expected a number"),
    ],
)
def test_bad_values_say_what_is_wrong(fn, text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        fn(text)


def test_good_values() -> None:
    assert port("0") == 0 and port("65535") == 65535
    assert positive_int("3") == 3
    assert non_negative_float("0") == 0.0
    assert positive_float("0.5") == 0.5


def test_sim_timing_goes_to_an_engine_command_line_and_back() -> None:
    """`kvgate up` and the bench write the --sim-* values into each engine's argv; the engine
    reads them back into its SimulationConfig, unset ones keeping its defaults."""
    from kvgate.engine.config import SimulationConfig

    parser = argparse.ArgumentParser()
    add_simulation_group(parser, "sim")
    timing = SimTiming(itl=0.025, kv_blocks=320)
    assert timing.argv() == ["--sim-itl", "0.025", "--sim-kv-blocks", "320"]
    assert SimTiming.from_args(parser.parse_args(timing.argv())) == timing
    engine = SimulationConfig().with_timing(timing)
    assert (engine.itl_base, engine.num_kv_blocks) == (0.025, 320)
    assert engine.prefill_time_per_token == SimulationConfig().prefill_time_per_token
    assert SimulationConfig().with_timing(SimulationConfig().timing()) == SimulationConfig()


def test_request_template_flag_help_states_the_real_limits() -> None:
    from kvgate.api.chat_template import UntrustedTemplateLimits

    limits = UntrustedTemplateLimits()
    mib = limits.max_memory_bytes // (1024 * 1024)
    assert f"limited to {limits.timeout_s:g} s and {mib} MiB" in REQUEST_TEMPLATE_LIMITS_HELP


SIM_FLAGS = ("sim_prefill_time_per_token", "sim_itl", "sim_itl_per_seq", "sim_kv_blocks", "sim_time_scale")
SIM_COMMANDS = (("engine", "serve"), ("up",), ("bench",))


def _sim_actions(path: tuple[str, ...]) -> dict[str, argparse.Action]:
    from kvgate.cli import build_parser

    parser = build_parser(list(path), only_selected=True)
    sub = parser
    for name in path:
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return {a.dest: a for a in sub._actions if a.dest in SIM_FLAGS}


def test_simulation_flags_are_declared_once() -> None:
    """`kvgate engine serve`, `up` and `bench` take the same --sim-* flags, with the same types
    and help; the engine's defaults are SimulationConfig's, `up` leaves them to the engine."""
    from kvgate.engine.config import SimulationConfig

    actions = {path: _sim_actions(path) for path in SIM_COMMANDS}
    for path, acts in actions.items():
        assert set(acts) == set(SIM_FLAGS), path
        for dest in SIM_FLAGS:
            first = actions[SIM_COMMANDS[0]][dest]
            assert (acts[dest].type, acts[dest].help) == (first.type, first.help), (path, dest)
    sim = SimulationConfig()
    engine = {dest: a.default for dest, a in actions["engine", "serve"].items()}
    assert engine == {
        "sim_prefill_time_per_token": sim.prefill_time_per_token,
        "sim_itl": sim.itl_base,
        "sim_itl_per_seq": sim.itl_per_seq,
        "sim_kv_blocks": sim.num_kv_blocks,
        "sim_time_scale": sim.time_scale,
    }
    assert all(a.default is None for a in actions["up",].values())


@pytest.mark.parametrize("path", SIM_COMMANDS)
@pytest.mark.parametrize(("flag", "value"), [("--sim-itl", "-1"), ("--sim-kv-blocks", "0")])
def test_simulation_flags_refuse_bad_values(path: tuple[str, ...], flag: str, value: str, capsys) -> None:  # type: ignore[no-untyped-def]
    from kvgate.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser(list(path), only_selected=True).parse_args([*path, flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
