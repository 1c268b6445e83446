"""`jitney` command line: one subcommand per module under ``jitney/commands``.

Each command module exposes ``register(subparsers)`` (adds its parser and sets ``func``) so that a
command's heavy imports (torch, the server) happen only when that command runs. User errors
(``CliError``, ``ValueError`` from validation, missing files) print one line, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "demo",
    "generate",
    "serve",
    "simulate",
    "roofline",
    "bench",
)


class CliError(Exception):
    """An error the user can fix; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jitney", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"jitney.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"jitney.commands.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, FileNotFoundError) as exc:
        print(f"jitney {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
