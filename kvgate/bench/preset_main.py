"""What every through-the-stack preset's `main` does once its flags are filled: check them, run,
print the report; a clear message and exit 2 for a bad flag or a stack that would not start."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

R = TypeVar("R")


class PresetError(RuntimeError):
    """A preset could not run (a component did not start): the message and what it saw."""

    def __init__(self, message: str, details: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.details = list(details)


def preset_main(
    args: argparse.Namespace,
    check: Callable[[argparse.Namespace], None],
    run: Callable[[], R],
    report: Callable[[argparse.Namespace, R, str], None],
    ok: Callable[[R], bool],
) -> int:
    """0 when `ok(result)`, 1 when not, 2 for a ValueError from `check` or `run` or a PresetError."""
    try:
        check(args)
        result = run()
    except ValueError as exc:
        print(f"kvgate bench: {exc}", file=sys.stderr)
        return 2
    except PresetError as exc:
        print(f"kvgate bench: {exc}", file=sys.stderr)
        for line in exc.details:
            print(f"    {line}", file=sys.stderr)
        return 2
    report(args, result, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return 0 if ok(result) else 1
