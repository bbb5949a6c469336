"""Options defined once, as fields of a frozen dataclass with their default, help and group; the
command line's flags are generated from them, the way `vllm serve` derives its flags from
`EngineArgs`. `EngineConfig` (the engine's options) and the server's `ServerConfig` are `Options`.

A field's type is str, int, float or bool, optionally `| None`, or `tuple[str, ...] | None` (a
flag that takes one or more values). Construction checks every field's type and choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

GiB = 1 << 30

# The groups of `--help`, in this order.
GROUPS = (
    "model",
    "cache",
    "scheduler",
    "parallel",
    "speculative",
    "lora",
    "observability",
    "server",
)


def gib_to_bytes(text: str) -> int:
    """A size in GiB as typed on the command line ("4", "0.25") to bytes."""
    return int(float(text) * GiB)


def option(
    default: Any,
    doc: str,
    *,
    group: str | None = None,
    choices: Sequence[str] | None = None,
    cli_type: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    aliases: Sequence[str] = (),
    env: str | None = None,
) -> Any:
    """A field with what the command line needs to offer it.

    `doc` is the field's documentation and the flag's help text; `group` its section of `--help`
    (GROUPS; none for an option of an engine group, whose section is the group's name in
    EngineConfig). `cli_type` parses the flag's text when it differs from the field's type
    (kv_cache_memory: GiB on the command line, bytes in the field); `aliases` are further
    spellings of the flag; `env` names an environment variable whose value is the flag's default
    (the field's own default stays `default`)."""
    if group is not None and group not in GROUPS:
        raise ValueError(f"option group must be one of {list(GROUPS)}, got {group!r}")
    metadata = {"help": doc, "choices": choices, "cli_type": cli_type, "metavar": metavar}
    metadata.update(group=group, aliases=tuple(aliases), env=env)
    return dataclasses.field(default=default, metadata=metadata)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a bool"}


class Options:
    """A frozen dataclass of `option` fields: checked on construction, offered as flags."""

    def __post_init__(self) -> None:
        # Every field: its type (None only where the type allows it), then its choices.
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if value is None and isinstance(hints[f.name], types.UnionType):
                continue  # unset: derived from the model or the machine
            kind, many = _scalar_type(hints[f.name])
            values = value if many and isinstance(value, tuple) else (value,)
            if many and not isinstance(value, tuple):
                raise ValueError(f"{f.name} must be a tuple of strings, got {value!r}")
            for item in values:
                if not _is_a(item, kind):
                    raise ValueError(f"{f.name} must be {_TYPE_NAMES[kind]}, got {item!r}")
                if choices is not None and item not in choices:
                    raise ValueError(f"{f.name} must be one of {list(choices)}, got {item!r}")

    @classmethod
    def option_fields(cls) -> list[tuple[str, dataclasses.Field, Any]]:
        """(its `--help` section, the field, its type) of each option: here each field of the
        class, in the section its `option()` names (EngineConfig gives its groups' fields)."""
        hints = typing.get_type_hints(cls)
        return [(f.metadata["group"], f, hints[f.name]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        names: Sequence[str] | None = None,
        groups: dict[str, argparse._ArgumentGroup] | None = None,
    ) -> dict[str, argparse._ArgumentGroup]:
        """One flag per field (or per field in `names`): `--max-num-seqs` for max_num_seqs; a bool
        gets `--flag` and `--no-flag`. Types, defaults, choices and help come from the field,
        each in its group's section (`groups`: sections made already, shared between configs);
        returns the sections."""
        groups = {} if groups is None else groups
        fields = [o for o in cls.option_fields() if names is None or o[1].name in names]
        for name in GROUPS:  # the sections in GROUPS' order, whichever config adds them first
            if name not in groups and any(section == name for section, _, _ in fields):
                groups[name] = parser.add_argument_group(f"{name} options")
        for section, f, hint in fields:
            meta = f.metadata
            flags = [f"--{f.name.replace('_', '-')}", *meta["aliases"]]
            default = f.default if meta["env"] is None else os.environ.get(meta["env"], f.default)
            help_text = meta["help"]
            if f.default is not None:
                shown = f.default
                if meta["cli_type"] is gib_to_bytes:
                    shown = f"{f.default / GiB:g}"  # in the flag's unit
                help_text += f" (default: {shown})"
            kind, many = _scalar_type(hint)
            group = groups[section]
            if kind is bool:
                group.add_argument(
                    *flags,
                    dest=f.name,
                    default=default,
                    action=argparse.BooleanOptionalAction,
                    help=help_text,
                )
                continue
            group.add_argument(
                *flags,
                dest=f.name,
                default=default,
                type=meta["cli_type"] or kind,
                choices=meta["choices"],
                metavar=meta["metavar"],
                nargs="+" if many else None,
                help=help_text,
            )
        return groups

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> typing.Self:
        """The config the parsed flags describe (raises ValueError for invalid values)."""
        values = {}
        for _, f, _ in cls.option_fields():
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)


def _is_a(value: Any, kind: type) -> bool:
    # bool is an int to Python, but `block_size=True` is a bug; an int is a fine float.
    if kind is bool or isinstance(value, bool):
        return isinstance(value, bool) and kind is bool
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


def _scalar_type(hint: Any) -> tuple[type, bool]:
    """The type a flag's text is parsed to, and whether the flag takes several: (int, False) for
    `int` and `int | None`, (str, True) for `tuple[str, ...] | None`."""
    if isinstance(hint, types.UnionType):
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is tuple:
        item, ellipsis = typing.get_args(hint)
        if item is str and ellipsis is Ellipsis:
            return str, True
    if hint not in (str, int, float, bool):
        raise TypeError(
            f"option fields must be str, int, float, bool or tuple[str, ...], got {hint!r}"
        )
    return hint, False
