"""A job's keyword arguments in the Python API are the command line's options.

`prefixflow.run(source, out=..., max_tokens=16)` and `Client.submit(...)` take the options
of `prefixflow run` and `prefixflow submit` as keywords, named as argparse names them
(`--max-tokens` -> `max_tokens`, `--no-dedupe` -> `no_dedupe=True`, `--job` -> `job`):
the same parser definitions (`prefixflow.cli.main.add_job_args`, `add_run_args`) give the
names, types, choices and defaults, and the same functions (`sampling_from`, `chat_from`,
`storage_options`) build the job from them. So there is one list of options; a keyword
that is not one of them, or a value its option refuses, is an `OptionError`.

Beyond the command line's: `storage_options`, a dict of the input file system's
arguments (the CLI's repeated `--storage-option KEY=VALUE`).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from prefixflow.shared.outcomes import CommandError, Exit, OptionError
from prefixflow.shared.wire import messages as m

T = TypeVar("T")

NOT_KEYWORDS = {"input", "out", "json", "help"}
"""Options a keyword does not give: the source and `out` are arguments; `--json` prints."""
API_DEFAULTS = {"no_progress": True}
"""Defaults that differ from the command line's: no progress bars (pass `no_progress=False`)."""


class JobOptions(NamedTuple):
    """A job's options as the command line would have parsed them, and the job built from them."""

    args: argparse.Namespace
    sampling: m.SamplingSpec
    chat: dict[str, Any]
    storage_options: dict[str, Any]


def parser(command: str) -> argparse.ArgumentParser:
    """The options of `prefixflow run` or `prefixflow submit` (the CLI's own definitions)."""
    from prefixflow.cli.options import add_job_args, add_run_args

    p = argparse.ArgumentParser(prog=f"prefixflow {command}", add_help=False)
    add_job_args(p, command)
    if command == "run":
        add_run_args(p)
    return p


def keywords(command: str) -> dict[str, argparse.Action]:
    """The keywords a job of `command` takes, each with its argparse action (type, choices,
    default, help)."""
    return {a.dest: a for a in parser(command)._actions if a.dest not in NOT_KEYWORDS}


def _value(action: argparse.Action, name: str, value: Any) -> Any:
    """`value` checked and converted as `action` would its text."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise OptionError(f"{name}={value!r}: want True or False")
        return value
    if value is None:
        if action.default is not None and not isinstance(action, argparse._AppendAction):
            raise OptionError(f"{name}=None: want a value (default {action.default!r})")
        return None
    if isinstance(action, argparse._AppendAction):
        items = [value] if isinstance(value, str) else list(value)
        return [_one(action, name, v) for v in items]
    return _one(action, name, value)


def _one(action: argparse.Action, name: str, value: Any) -> Any:
    if isinstance(value, bool) and action.type not in (None, str):
        raise OptionError(f"{name}={value!r}: want a number")
    if action.type is not None:
        try:
            converted = action.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise OptionError(f"{name}={value!r}: {exc}") from None
        if isinstance(converted, int) and not isinstance(value, str) and converted != value:
            raise OptionError(f"{name}={value!r}: want a whole number")
        value = converted
    elif not isinstance(value, str):
        raise OptionError(f"{name}={value!r}: want a string")
    if action.choices is not None and value not in action.choices:
        raise OptionError(f"{name}={value!r}: want one of {', '.join(map(str, action.choices))}")
    return value


def refused(fn: Callable[[], T]) -> T:
    """`fn()`, a `CommandError` of the command line's (a `SystemExit`) as a typed exception:
    exit code 2 an `OptionError`, else its message as a `ClusterError`."""
    from prefixflow.shared.outcomes import ClusterError

    try:
        return fn()
    except CommandError as exc:
        raise (OptionError if exc.code == Exit.USAGE else ClusterError)(exc.message) from None


def job_options(command: str, source: str, out: str, given: dict[str, Any]) -> JobOptions:
    """The options of a job of `command` (`run`, `submit`) from the API's keywords."""
    from prefixflow.cli.options import chat_from, sampling_from, storage_options

    given = dict(given)
    extra_storage = given.pop("storage_options", None) or {}
    if not isinstance(extra_storage, dict):
        raise OptionError(f"storage_options={extra_storage!r}: want a dict")
    actions = keywords(command)
    args = parser(command).parse_args([source, "--out", str(out)])
    for name, value in API_DEFAULTS.items():
        setattr(args, name, value)
    for name, value in given.items():
        action = actions.get(name)
        if action is None:
            near = difflib.get_close_matches(name, list(actions) + ["storage_options"], n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise OptionError(f"{name}: not an option of prefixflow {command}{hint}; the options: "
                              f"{', '.join(sorted(actions))}, storage_options")
        setattr(args, name, _value(action, name, value))
    sampling = refused(lambda: sampling_from(args))
    chat = refused(lambda: chat_from(args))
    storage = {**refused(lambda: storage_options(args)), **extra_storage}
    return JobOptions(args, sampling, chat, storage)
