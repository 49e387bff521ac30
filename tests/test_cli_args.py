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
