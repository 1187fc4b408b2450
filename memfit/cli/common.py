"""What the ``memfit`` subcommands share: the usage error, the model flags, ``--set``
parsing, the device choice and building a built-in model.

``memfit.cli.main`` imports the subcommands; each subcommand imports only this module, never
``main`` or another subcommand.

Example::

    add_model_arguments(parser)                       # --model --precision --set --device
    args = parser.parse_args(["--set", "n_layer=2"])
    overrides = parse_overrides(args.overrides, model_config_cls(args.model))
    model, loss_fn, batch_fn = builtin_model(args.model, overrides, data="synthetic",
                                             device=pick_device(args.device), seed=0)
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from memfit.models import BuiltModel


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


def pick_device(name: str | None) -> torch.device:
    """``--device``'s value, or cuda when it is available and cpu otherwise."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def model_config_cls(name: str) -> type:
    """The config dataclass of the built-in model ``name`` (``--model``); a usage error for
    an unknown name."""
    from memfit.models import MODELS

    if name not in MODELS:
        raise UsageError(f"unknown --model {name!r}; valid: {', '.join(MODELS)}")
    return MODELS[name].config_cls


def parse_overrides(items: list[str], config_cls: type) -> dict[str, Any]:
    """``["n_layer=6", "dropout=0.1"]`` → typed values for the config dataclass's fields."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    defaults = config_cls()
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise UsageError(
                f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}"
            )
        current = getattr(defaults, key)
        try:
            if isinstance(current, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                value: Any = text.lower() in ("true", "1")
            elif isinstance(current, int):
                value = int(text)
            elif isinstance(current, float):
                value = float(text)
            elif isinstance(current, tuple):
                value = tuple(int(v) for v in text.split(","))
            else:
                value = text
        except ValueError:
            raise UsageError(f"--set {item!r}: {key} needs a {type(current).__name__}") from None
        out[key] = value
    return out


def builtin_model(
    name: str, overrides: dict[str, Any], *, data: str | None, device: torch.device, seed: int
) -> BuiltModel:
    """``(model, loss_fn, batch_fn)`` of the built-in model ``name``, its weights drawn
    after ``torch.manual_seed(seed)``."""
    from memfit.models import build_model

    torch.manual_seed(seed)
    return build_model(name, data=data, device=device, **overrides)
