"""The benchmarks' command lines both ways: integer options declared from keywords, and the flags
of a command a benchmark starts (its worker, `pagedserve bench ...`) built from values. A keyword
is the option's name with dashes as underscores, as argparse names its attribute."""

from __future__ import annotations

import argparse


def add_int_options(parser: argparse.ArgumentParser, **defaults: int | None) -> None:
    """One `--name` option of type int per keyword, with the keyword's value as its default."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


def flags(**values: object) -> list[str]:
    """`--name value` for each keyword, in order; a value of None leaves its flag out."""
    argv = []
    for name, value in values.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv
