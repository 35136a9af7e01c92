"""Argument types and the parser class of the command line.

Each type turns one option's text into a value or rejects it with what it expects and what it
got; argparse prints that as one line, ``flashrt CMD: error: argument --opt: expected ..., got ...``,
and exits 2. :class:`Parser` adds ``--debug`` to every (sub)command.
"""
from __future__ import annotations

import argparse
import math

SEED_MAX = 2**63 - 1  # torch generators take signed 64-bit seeds


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, with ``--debug`` on every (sub)command."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="print the traceback of a failure")

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _reject(expected: str, text: str):
    raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")


def int_range(low: int, high: int | None = None):
    """An integer in [low, high] (no upper limit when ``high`` is None)."""
    expected = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            _reject(expected, text)
        if value < low or (high is not None and value > high):
            _reject(expected, text)
        return value

    parse.__name__ = "integer"
    return parse


def float_range(low: float, high: float = math.inf, low_open: bool = True):
    """A finite number above ``low`` (or at it when not ``low_open``) and at most ``high``."""
    expected = f"a finite number {'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            _reject(expected, text)
        if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
            _reject(expected, text)
        return value

    parse.__name__ = "number"
    return parse


def nonempty(what: str):
    """Any text but the empty string (which would otherwise mean a default, or the current directory)."""
    def parse(text: str) -> str:
        if not text:
            _reject(f"a non-empty {what}", text)
        return text

    parse.__name__ = what
    return parse


def device(text: str) -> str:
    """``cpu``, ``cuda``, ``cuda:N``, ``npu`` or ``npu:N`` that exists here."""
    from flashrt.profile_match import check_device

    try:
        check_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("device: ")) from None
    return text


def memory_size(text: str) -> int:
    """Bytes of a size with a unit, e.g. ``24GiB`` (:func:`flashrt.memory_cap.parse_size`)."""
    from flashrt.memory_cap import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


memory_size.__name__ = "size"


def add_simulation_options(p) -> None:
    """``--profile`` and ``--memory-limit`` of a command that runs on a device (``run``,
    ``conformance``): run as the card that profile describes, in at most that much device memory."""
    p.add_argument("--profile", dest="command_profile", default=None, type=nonempty("profile"),
                   help="hardware profile name or YAML path used instead of the detected one "
                        "(the same as the global --profile)")
    p.add_argument("--memory-limit", default=None, type=memory_size, metavar="SIZE",
                   help="cap the device memory torch may allocate, e.g. 24GiB (CUDA only; docs/hardware.md)")


seed = int_range(0, SEED_MAX)
positive_int = int_range(1)
