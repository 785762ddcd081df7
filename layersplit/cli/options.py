"""The parser and argument types shared by every subcommand (and the maintainers' tools): each rejects a
bad value at parse time with one line that argparse prefixes with the subcommand and the flag
(``layersplit prefill: error: argument --hit: expected a number in [0, 1), got 1.0``), and :class:`Parser`
refuses a flag given twice with different values (``argument --cp: given twice (2, then 4): give it
once``), before any work starts."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are the one line every other bad input is: ``PROG: error: ...``
    (argparse prints its usage block first; ``--help`` still shows it), and which refuses one setting given
    two different values (:class:`_StoreOnce`) where argparse keeps the last without a word. Subcommands
    inherit the class (``add_subparsers`` makes each subparser one)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)  # every flag that takes a value; append / count still repeat
        self.register("action", "store", _StoreOnce)
        self.given: dict[str, tuple[str, object, int]] = {}

    def parse_known_args(self, args=None, namespace=None):
        self.given = {}  # dest -> (the spelling first given, its parsed value, times given), for this parse only
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _StoreOnce(argparse._StoreAction):
    """argparse's ``store`` that refuses a second, different value of its setting: the same flag twice
    (``--cp 2 --cp 4``) or two spellings of it (``--kv-dtype bf16 --kv-cache-dtype fp8_e4m3``, a hidden old
    name beside the new one). Values are compared as parsed, so a repeat that agrees (``--kv-dtype fp8
    --kv-cache-dtype fp8_e4m3``, ``--cp 2 --cp 2``) drops nothing and is taken."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None:  # a positional is given once by construction
            assert isinstance(parser, Parser), f"expected an options.Parser, got {type(parser).__name__}"
            spelling, first, times = parser.given.get(self.dest, (option_string, values, 0))
            parser.given[self.dest] = (spelling, first, times + 1)
            if first != values:
                raise argparse.ArgumentError(None, _given_again(spelling, first, option_string, values, times + 1))
        super().__call__(parser, namespace, values, option_string)


def _given_again(spelling: str, first, again: str, value, times: int) -> str:
    if spelling == again:
        count = "twice" if times == 2 else f"{times} times"
        return f"argument {again}: given {count} ({_shown(first)}, then {_shown(value)}): give it once"
    return (f"{spelling}/{again}: expected one value for one setting, got {spelling} {_shown(first)} and {again} "
            f"{_shown(value)}; give one of them")


def _shown(value) -> str:
    return repr(str(value)) if isinstance(value, (str, Path)) else str(value)


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


def name_or_path(text: str) -> str:
    """A config name or path: not empty (an empty path is the current folder: never what was meant), no name
    in it too long for the file system."""
    _path(text, "a config name or path")
    return text


def writable_file(text: str) -> Path:
    """A file path whose folder exists (or can be created) and is writable; the file itself is not
    created here, so a run that fails later leaves nothing behind."""
    path = _path(text, "a file path")
    if path.exists() and path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got the folder {text!r}")
    _check_dir_writable(path.parent, text)
    return path


def writable_dir(text: str) -> Path:
    """A folder that exists and is writable, or that can be created under a writable ancestor."""
    path = _path(text, "a folder path")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder, got the file {text!r}")
    _check_dir_writable(path, text)
    return path


NAME_MAX = 255  # bytes in one file or folder name (Linux, macOS; os.pathconf says so where it can)


def _path(text: str, want: str) -> Path:
    """``text`` as a path: not empty (``Path("")`` is the current folder: never what was meant), and every
    name in it short enough for the file system."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    long = next((part for part in Path(text).parts if len(os.fsencode(part)) > NAME_MAX), None)
    if long is not None:
        raise argparse.ArgumentTypeError(f"expected names of at most {NAME_MAX} bytes in {want}, got one of "
                                         f"{len(os.fsencode(long))} ({long[:24]}...)")
    return Path(text)


def _check_dir_writable(folder: Path, text: str) -> None:
    """``folder`` (or its nearest existing ancestor, where it would be created) takes a new entry: tried for
    real with a temporary folder made and removed at once, since permission bits do not tell (root, a
    read-only mount, /proc)."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(probe)!r} is not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".layersplit-probe-", dir=probe))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the folder {str(probe)!r} is not writable "
                                         f"({exc.strerror or exc})") from None


def readable_file(text: str) -> Path:
    """A file that exists and can be read."""
    path = _path(text, "an existing file")
    try:
        found = path.is_file()
    except OSError as exc:  # a path the system refuses to look up (too long, a loop of links)
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc.strerror or exc}") from None
    if not found:
        raise argparse.ArgumentTypeError(f"expected an existing file, got {text!r}")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}")
    return path


_FLAG_OF = {"cp_size": "cp", "strategy": "ownership"}  # library argument names that differ from the flag


def as_flag(message: str, flag_of: dict[str, str] | None = None) -> str:
    """A library error that starts with its argument's name (``context_len: expected ...``) as the
    flag a user typed (``--context-len: expected ...``); other messages unchanged. ``flag_of``: a
    command's own names that differ from its flags (``{"kill": "kill-rank"}``)."""
    head, sep, rest = message.partition(" ")
    name = head.rstrip(":")
    if sep and name.isidentifier() and name.islower() and (head.endswith(":") or rest.startswith("'")):
        flag = {**_FLAG_OF, **(flag_of or {})}.get(name, name)
        return "--" + flag.replace("_", "-") + message[len(name):]
    return message


def stage_printer(command: str):
    """A ``progress(stage)`` callback that writes ``layersplit <command>: <stage>...`` to stderr with the
    seconds since the first stage (stdout stays clean for ``--json``)."""
    start = time.perf_counter()

    def say(stage: str) -> None:
        print(f"layersplit {command}: {stage}... ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)

    return say
