"""Argument types shared by every subcommand: each rejects a bad value at parse time with a message
that argparse prefixes with the subcommand and the flag (``layersplit prefill: error: argument
--hit: expected a number in [0, 1), got 1.0``), before any work starts."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def int_at_least(low: int, high: int | None = None):
    """An integer in ``[low, high]`` (``high`` None: no upper bound)."""
    want = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
        return value

    return parse


SEED_MAX = 2**63 - 1


def seed(text: str) -> int:
    """A random seed: an integer in ``[0, 2**63 - 1]`` (what ``torch.Generator.manual_seed`` takes)."""
    return int_at_least(0, SEED_MAX)(text)


def number_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """A finite number in the interval written as ``[low, high]`` with the given open ends."""
    want = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if not (value > low if low_open else value >= low) or not (value < high if high_open else value <= high):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text}")
        return value

    return parse


def writable_file(text: str) -> Path:
    """A file path whose folder exists (or can be created) and is writable; the file itself is not
    created here, so a run that fails later leaves nothing behind."""
    path = Path(text)
    if path.exists() and path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got the folder {text!r}")
    _check_dir_writable(path.parent if str(path.parent) else Path("."), text)
    return path


def writable_dir(text: str) -> Path:
    """A folder that exists and is writable, or that can be created under a writable ancestor."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder, got the file {text!r}")
    _check_dir_writable(path, text)
    return path


def _check_dir_writable(folder: Path, text: str) -> None:
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(probe)!r} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the folder {str(probe)!r} is not writable")


def readable_file(text: str) -> Path:
    """A file that exists and can be read."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"expected an existing file, got {text!r}")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}")
    return path


_FLAG_OF = {"cp_size": "cp"}  # library argument names that differ from the flag


def as_flag(message: str) -> str:
    """A library error that starts with its argument's name (``context_len: expected ...``) as the
    flag a user typed (``--context-len: expected ...``); other messages unchanged."""
    head, sep, rest = message.partition(" ")
    name = head.rstrip(":")
    if sep and name.isidentifier() and name.islower() and (head.endswith(":") or rest.startswith("'")):
        flag = _FLAG_OF.get(name, name)
        return "--" + flag.replace("_", "-") + message[len(name):]
    return message


def stage_printer(command: str):
    """A ``progress(stage)`` callback that writes ``layersplit <command>: <stage>...`` to stderr with the
    seconds since the first stage (stdout stays clean for ``--json``)."""
    start = time.perf_counter()

    def say(stage: str) -> None:
        print(f"layersplit {command}: {stage}... ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)

    return say
