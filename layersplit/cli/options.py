"""Argument types shared by every subcommand: each rejects a bad value at parse time with a message
that argparse prefixes with the subcommand and the flag (``layersplit prefill: error: argument
--hit: expected a number in [0, 1), got 1.0``), before any work starts."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are the one line every other bad input is: ``PROG: error: ...``
    (argparse prints its usage block first; ``--help`` still shows it). Subcommands inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


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


def check_aliases(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace) -> None:
    """Refuse two spellings of one setting given different values (``--kv-dtype bf16 --kv-cache-dtype fp8_e4m3``,
    a hidden old name beside the new one): argparse keeps the last and drops the other without a word. The
    values are compared as parsed (``--kv-dtype fp8`` and ``--kv-cache-dtype fp8_e4m3`` agree)."""
    parser = _chosen_parser(parser, args)
    seen: dict[str, tuple[str, object]] = {}  # dest -> (the spelling first given, its parsed value)
    tokens = iter(argv[:argv.index("--")] if "--" in argv else argv)
    for token in tokens:
        flag, eq, text = token.partition("=")
        action = _option(parser, flag) if token.startswith("--") else None
        if action is None or action.nargs is not None or not isinstance(action, argparse._StoreAction):
            continue  # flags without a value, and repeatable ones, cannot disagree
        if not eq:
            text = next(tokens, "")
        try:
            value = action.type(text) if callable(action.type) else text
        except (argparse.ArgumentTypeError, TypeError, ValueError):
            continue  # argparse accepted the line, so this was not the flag's value after all
        spelling = next(o for o in action.option_strings if o.startswith(flag))
        first = seen.setdefault(action.dest, (spelling, value))
        if first[0] != spelling and first[1] != value:
            raise ValueError(f"{first[0]}/{spelling}: expected one value for one setting, got {first[0]} "
                             f"{_shown(first[1])} and {spelling} {_shown(value)}; give one of them")


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser whose flags this command line used: down through each subcommand chosen."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, sub.dest, None) not in sub.choices:
            return parser
        parser = sub.choices[getattr(args, sub.dest)]


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    """The action ``flag`` names in ``parser``: exactly, or as argparse's unique prefix."""
    if flag in parser._option_string_actions:
        return parser._option_string_actions[flag]
    found = {a for o, a in parser._option_string_actions.items() if o.startswith(flag)}
    return found.pop() if len(found) == 1 else None
