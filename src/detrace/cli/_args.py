"""Argument parsing shared by the subcommands: argparse that raises `UsageError` instead of exiting."""

from __future__ import annotations

import argparse
import math
from typing import Any, NoReturn

from detrace.errors import UsageError


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors become `UsageError` (one sentence, exit 2, no traceback)."""

    def __init__(self, command: str, description: str, **kwargs: Any) -> None:
        super().__init__(prog=f"detrace {command}", description=description, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see 'detrace {self.prog.split()[-1]} --help')")


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split `[options] -- CMD...` into (options, CMD). CMD is empty when there is no `--`."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []


def seconds(text: str) -> float:
    """An argparse type for a duration: a positive, finite number of seconds (`nan` and `inf` are no timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive, finite number of seconds")
    return value
