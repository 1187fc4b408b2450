"""The ``memfit`` command: one subcommand per file in this package.

Exit codes: 0 success, 1 a memfit error while running (message on stderr), 2 bad usage,
75 ``memfit train`` stopped on SIGTERM or SIGINT after saving its state (EX_TEMPFAIL: run
the same command again to continue; :mod:`memfit.engine.preemption`), 130 interrupted by
Ctrl-C before training began.

This module imports the subcommands (``train_command`` for ``memfit train``, and so on); what
they share is in :mod:`memfit.cli.common`. Those modules import torch and memfit's API inside the
functions that use them, so building the parser (``memfit --help``, a bad flag) costs
neither.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from memfit.cli import (
    estimate_command,
    plan_command,
    report_command,
    train_command,
    tune_command,
)
from memfit.cli.common import UsageError, join_size_values
from memfit.errors import ConfigError, MemfitError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memfit",
        description="Fit PyTorch training in the memory you have: mixed precision and "
        "activation checkpointing, planned together.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (train_command, plan_command, estimate_command, tune_command, report_command):
        module.add_parser(sub)
    return parser


def _subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` (its usage line is the one an error shows)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    parser = build_parser()
    # The command line as given (not sys.argv when called as main([...])): --nproc runs it again.
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(join_size_values(given))
    args.argv = given
    try:
        return int(args.run(args) or 0)
    except (UsageError, ConfigError) as exc:
        _subcommand_parser(parser, args.command).print_usage(sys.stderr)
        print(f"memfit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except MemfitError as exc:
        print(f"memfit {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"memfit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
