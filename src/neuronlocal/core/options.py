"""Command-line values, checked where argparse parses them: bad input is exit 2, one line.

Every numeric option of every command is typed with `whole` or `amount`, so a value out of
its range (a negative price, nan, a sequence of 10**12 tokens, a batch of 0) is refused
before anything runs, naming the option and the accepted range; `Parser` prints argparse's
errors as that one line (no usage block).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

# Past any real model or layout, and small enough for every C type a value reaches.
MAX_WHOLE = 2**31 - 1


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2); subcommands inherit it."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)",
              file=sys.stderr)
        sys.exit(2)


def whole(low: int = 1, high: int = MAX_WHOLE) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number from {low} to "
                                             f"{high}")
        return value

    parse.__name__ = "whole number"
    return parse


def amount(low: float = 0.0, high: float = float(MAX_WHOLE),
           low_inclusive: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number above `low` (or from it) up to `high`."""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        above = value >= low if low_inclusive else value > low
        if not (above and value <= high):  # False for nan
            bound = "from" if low_inclusive else "above"
            raise argparse.ArgumentTypeError(f"{raw!r} is not a number {bound} {low:g} up to "
                                             f"{high:g}")
        return value

    parse.__name__ = "number"
    return parse
