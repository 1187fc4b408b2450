"""The ``memfit`` command: one subcommand per file in this package.

Exit codes: 0 success, 1 a memfit error while running (message on stderr), 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from memfit.errors import ConfigError, MemfitError


class UsageError(Exception):
    """A flag's value is wrong: reported with the usage line and exit code 2."""


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every subcommand that builds a model takes: ``--model``, ``--precision``,
    ``--set KEY=VALUE`` (into ``args.overrides``) and ``--device``."""
    p.add_argument("--model", default="gpt", help="gpt | resnet | lstm (default: gpt)")
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        help="fp32 | bf16-mixed | fp16-mixed | bf16-master | fp16-master (or an alias; "
        "default: bf16-mixed)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="built-in model config field, e.g. --set n_layer=6 (repeatable)",
    )
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")


def build_parser() -> argparse.ArgumentParser:
    from memfit.cli import plan, report, train

    parser = argparse.ArgumentParser(
        prog="memfit",
        description="Fit PyTorch training in the memory you have: mixed precision and "
        "activation checkpointing, planned together.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (train, plan, report):
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (UsageError, ConfigError) as exc:
        parser.print_usage(sys.stderr)
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
