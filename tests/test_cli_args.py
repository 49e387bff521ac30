"""The flag value types every kvgate command shares: bad values are argparse errors (exit 2)."""

from __future__ import annotations

import argparse

import pytest

from kvgate.api.cli_args import boolean, non_negative_float, port, positive_int


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
    ],
)
def test_bad_values_say_what_is_wrong(fn, text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        fn(text)


def test_good_values() -> None:
    assert port("0") == 0 and port("65535") == 65535
    assert positive_int("3") == 3
    assert non_negative_float("0") == 0.0


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
