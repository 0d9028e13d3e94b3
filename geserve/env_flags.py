"""GESERVE_<FLAG> environment variables -> the server's flags, placed before the command line's, which win."""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Callable, Mapping, Sequence

from geserve.errors import InvalidArgumentError

PREFIX = "GESERVE_"
# GESERVE_ variables that are not flags: the test suite's and the benchmarks' own (tests/support.py, tests/perf,
# the Makefile's npu-check), set in the environment the servers they start inherit.
RESERVED_PREFIXES = ("GESERVE_TEST_", "GESERVE_BENCH_", "GESERVE_NPU_")
# The images' build argument (deploy/docker), in the environment of every step of their build; --version is no setting.
RESERVED_NAMES = frozenset({"GESERVE_VERSION"})
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def variable_of(option: str) -> str:
    """The variable that sets a flag: `--http-port` -> `GESERVE_HTTP_PORT`."""
    return PREFIX + option.removeprefix("--").replace("-", "_").upper()


def environment_argv(
    build_parser: Callable[[], argparse.ArgumentParser], argv: Sequence[str], environ: Mapping[str, str]
) -> list[str]:
    """`argv` led by the flags the GESERVE_ variables of `environ` set, where `argv` does not give them: a store flag's
    last occurrence wins anyway, and a repeatable flag given in `argv` takes only `argv`'s values. `build_parser`
    makes the server's parser afresh (its defaults are changed here). Each variable's value is checked as its flag
    would be, also where `argv` overrides it; a variable that names no flag, names one that cannot be set, or holds a
    value its flag refuses raises InvalidArgumentError naming it."""
    parser = build_parser()
    options = _settable_options(parser)
    given = {name: value for name, value in environ.items() if name.startswith(PREFIX)}
    reserved = {name for name in given if name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES)}
    unknown = sorted(name for name in given.keys() - reserved if name not in options)
    if unknown:
        raise InvalidArgumentError(_unknown(unknown[0], options, _unsettable(parser)))
    if not given.keys() & options.keys():
        return list(argv)
    _quiet(parser)
    on_command_line = _dests_given(parser, argv)
    chosen: dict[str, str] = {}
    entries: list[str] = []
    for name in sorted(given.keys() & options.keys()):
        option, action = options[name]
        if action.dest in chosen:
            raise InvalidArgumentError(f"{chosen[action.dest]} and {name} both set {option}: set one of them")
        chosen[action.dest] = name
        own = _entries(name, option, action, given[name])
        _check(parser, name, given[name], own)  # also where the command line overrides it: no bad value is hidden
        if action.dest not in on_command_line:
            entries += own
    return [*entries, *argv]


def _settable_options(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.Action]]:
    """Variable -> (the flag it stands for, its action), for every flag but --help and --version."""
    options = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                options[variable_of(option)] = (option, action)
    return options


def _unsettable(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Variable -> flag, for the flags that are not settings (--help, --version)."""
    return {
        variable_of(option): option
        for action in parser._actions
        if isinstance(action, argparse._HelpAction | argparse._VersionAction)
        for option in action.option_strings
        if option.startswith("--")
    }


def _unknown(name: str, options: Mapping[str, tuple[str, argparse.Action]], unsettable: Mapping[str, str]) -> str:
    if name in unsettable:
        return f"environment variable {name}: {unsettable[name]} is not a setting and cannot come from the environment"
    close = difflib.get_close_matches(name, options, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    reserved = ", ".join([*(f"{prefix}*" for prefix in RESERVED_PREFIXES), *sorted(RESERVED_NAMES)])
    return (
        f"environment variable {name} names no geserve flag{hint} (GESERVE_<FLAG> sets --<flag>; {reserved} are "
        "reserved for geserve's tests and builds)"
    )


def _quiet(parser: argparse.ArgumentParser) -> None:
    """The parser as a checker: no defaults (what it returns is what it was given), nothing required, and errors
    raised instead of ending the process."""
    parser.exit_on_error = False
    for action in parser._actions:
        action.default = argparse.SUPPRESS
        action.required = False


def _dests_given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    try:
        namespace, _ = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as error:
        raise InvalidArgumentError(str(error)) from None
    return set(vars(namespace))


def _entries(name: str, option: str, action: argparse.Action, value: str) -> list[str]:
    """The command-line entries a variable stands for: a flag that takes no value is given for true; a repeatable
    flag takes a JSON list of strings (as pydantic's settings read a list from the environment) or one value."""
    if action.nargs == 0:
        switch = value.strip().lower()
        if switch not in _TRUE | _FALSE:
            raise InvalidArgumentError(f"{name}={value}: expected true or false")
        return [option] if switch in _TRUE else []
    if not isinstance(action, argparse._AppendAction) or not value.lstrip().startswith("["):
        return [f"{option}={value}"]
    try:
        values = json.loads(value)
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(f"{name}: a value starting with '[' is a JSON list of strings: {error}") from None
    if not isinstance(values, list) or not all(isinstance(item, str) for item in values):
        raise InvalidArgumentError(f"{name}: a value starting with '[' is a JSON list of strings, got {value}")
    return [f"{option}={item}" for item in values]


def _check(parser: argparse.ArgumentParser, name: str, value: str, entries: list[str]) -> None:
    """A variable's entries parsed on their own, so that a bad value is reported with the variable's name."""
    try:
        _, extras = parser.parse_known_args(entries)
    except argparse.ArgumentError as error:
        raise InvalidArgumentError(f"{name}={value}: {error}") from None
    if extras:
        raise InvalidArgumentError(f"{name}={value}: not a value of its flag ({' '.join(extras)})")
