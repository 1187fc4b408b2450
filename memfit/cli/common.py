"""What the ``memfit`` subcommands share: the usage error, the model flags, ``--set``
parsing, the device choice (checked), moving a batch there, building a built-in model, and
the one form every ``--factory MODULE:FUNCTION`` returns (:class:`memfit.workload.Workload`,
loaded by :func:`load_workload`).

``memfit.cli.main`` imports the subcommands; a subcommand imports this module (and
``train`` its start-up helpers, :mod:`memfit.cli.start`), never ``main`` or another
subcommand.

Example::

    add_model_arguments(parser)                       # --model --precision --set --device
    args = parser.parse_args(["--set", "n_layer=2"])
    overrides = parse_overrides(args.overrides, model_config_cls(args.model))
    model, loss_fn, batch_fn = builtin_model(args.model, overrides, data="synthetic",
                                             device=pick_device(args.device), seed=0)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.deprecations import warn_renamed
from memfit.errors import ConfigError
from memfit.workload import Workload

# torch is imported where it is used: building the parser (memfit --help) needs none of it.
if TYPE_CHECKING:
    import torch

    from memfit.models import BuiltModel


class UsageError(Exception):
    """A flag's value is wrong: reported with the usage line and exit code 2."""


#: The defaults of the model flags (``--set`` lands in ``overrides``).
MODEL_DEFAULTS: dict[str, Any] = {"model": "gpt", "precision": "auto", "overrides": []}


def add_model_arguments(p: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """The flags every subcommand that builds a model takes: ``--model``, ``--precision``,
    ``--set KEY=VALUE`` (into ``args.overrides``) and ``--device``.

    With ``defaults=False`` the first three are left out of the parsed namespace unless
    given, so a caller can tell a given flag from a default (it fills in
    :data:`MODEL_DEFAULTS` itself); ``--device`` is None unless given either way.

    Example::

        add_model_arguments(parser, defaults=False)
        given = vars(parser.parse_args(["--precision", "fp32"]))   # no "model" key
    """

    def default(name: str) -> Any:
        return MODEL_DEFAULTS[name] if defaults else argparse.SUPPRESS

    p.add_argument("--model", default=default("model"), help="gpt | resnet | lstm (default: gpt)")
    p.add_argument(
        "--precision",
        default=default("precision"),
        help="auto | fp32 | bf16-mixed | fp16-mixed | bf16-master | fp16-master | bf16-sr "
        "(or an alias; default: auto, the faster of fp32 and bf16-mixed for this model on this "
        "machine, measured on its first micro-batch)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=default("overrides"),
        metavar="KEY=VALUE",
        help="built-in model config field, e.g. --set n_layer=6 (repeatable)",
    )
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")


def add_model_choice(p: argparse.ArgumentParser, set_help: str) -> None:
    """``--model`` and ``--set KEY=VALUE`` (into ``args.overrides``), for the subcommands
    that build a model without training it (``estimate``, ``tune``).

    Example::

        add_model_choice(parser, "a built-in model's config field (repeatable)")
    """
    p.add_argument("--model", default="gpt", help="gpt | resnet | lstm (default: gpt)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=set_help,
    )


#: What ``--factory`` takes, shown in its help and its errors.
FACTORY_HELP = (
    "your model: MODULE:FUNCTION or path/to/file.py:FUNCTION, where FUNCTION() returns a "
    "memfit.Workload(model_fn, batch_fn, loss_fn) (examples/my_model.py)"
)


def add_factory_argument(p: argparse.ArgumentParser, **kwargs: Any) -> None:
    """``--factory MODULE:FUNCTION`` or ``--factory path/to/file.py:FUNCTION`` (into
    ``args.factory``, None unless given): the user's model, as the :class:`Workload` that
    ``FUNCTION()`` returns (:func:`load_workload`). ``kwargs`` go to ``add_argument``
    (``memfit train`` passes ``default=argparse.SUPPRESS``).

    Example::

        add_factory_argument(parser)
        parser.parse_args(["--factory", "mypkg.models:workload"]).factory
    """
    kwargs.setdefault("default", None)
    p.add_argument("--factory", metavar="MODULE:FUNCTION", help=FACTORY_HELP, **kwargs)


#: The flags whose value is a memory size, in every subcommand that takes one.
SIZE_FLAGS = ("--budget", "--device-memory")


def positive_size(text: str) -> str:
    """The ``type`` of a size flag (:data:`SIZE_FLAGS`): ``text`` unchanged when it reads as
    a positive size, else argparse's error with "must be a positive size like 2GiB" (and
    the subcommand's usage line). The bytes are worked out later (a fraction such as 0.5
    needs the device).

    Example::

        positive_size("2GiB")    # "2GiB"
        positive_size("-5MiB")   # ArgumentTypeError: must be a positive size like 2GiB ...
    """
    from memfit.units import check_size_text

    try:
        return check_size_text(text)
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"must be a positive size like 2GiB, 512MiB or 16GB, got {text!r}"
        ) from None


#: What ``--activation-storage`` takes, beside keep and recompute (each plan may use):
#: ``memfit.checkpoint.storage_stage.CODED``, written out so that building the parser
#: imports no torch (tests/test_cli.py checks that they agree).
CODED_STORAGES = ("bf16", "int8", "fp8", "offload")


def activation_storage(text: str) -> tuple[str, ...]:
    """The ``type`` of ``--activation-storage``: comma-separated coded storages, returned
    as the ``activation_storage=`` the Engine and ``memfit.plan`` take.

    Example::

        activation_storage("bf16,fp8")   # ("keep", "recompute", "bf16", "fp8")
        activation_storage("int4")       # ArgumentTypeError: bf16, int8, fp8, offload
    """
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in CODED_STORAGES]
    if not kinds or bad:
        raise argparse.ArgumentTypeError(
            f"takes one or more of {', '.join(CODED_STORAGES)}, comma-separated "
            f"(e.g. bf16,fp8), got {text!r}"
        )
    from memfit.checkpoint.planner import storage_choices

    return storage_choices(kinds)


def add_activation_storage_argument(p: argparse.ArgumentParser, **kwargs: Any) -> None:
    """``--activation-storage KINDS`` on ``p`` (``kwargs``: argparse's, e.g. a default)."""
    p.add_argument(
        "--activation-storage",
        type=activation_storage,
        metavar="KINDS",
        help="beside keep and recompute, the coded storages the optimal plan may keep a "
        "block's activations in where the budget needs it, comma-separated: bf16, int8, fp8, "
        "offload (CUDA) (docs/tiers.md; default: none)",
        **kwargs,
    )


def join_size_values(argv: list[str]) -> list[str]:
    """``argv`` with a size flag and a value that starts with ``-`` joined into one
    argument (``--budget -5MiB`` → ``--budget=-5MiB``): argparse takes ``-5MiB`` for an
    option and says only "expected one argument"; joined, :func:`positive_size` names
    what is wrong.

    Example::

        join_size_values(["plan", "--budget", "-5MiB"])   # ["plan", "--budget=-5MiB"]
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg in SIZE_FLAGS and nxt is not None and nxt[:2] not in ("--",) and nxt[:1] == "-":
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


#: torch's C++ note when memfit measures a step with its profiler (``memfit.allocator`` on
#: CPU) and a tensor made before the measurement is freed inside it: expected there, and
#: the measurement accounts for it, so the commands drop it (:func:`without_profiler_note`).
PROFILER_NOTE = "was allocated before the profiling started"


@contextlib.contextmanager
def without_profiler_note() -> Iterator[None]:
    """Inside the block, every line written to the process's stderr (file descriptor 2) is
    held back and written on leaving, except torch's :data:`PROFILER_NOTE` lines. That note
    is printed by torch's C++ code, not through Python's ``warnings``, so
    ``warnings.catch_warnings`` cannot silence it. Where stderr cannot be redirected (no
    file descriptor 2), nothing is filtered.

    Example::

        with without_profiler_note():
            result = memfit.tune(model_fn, batch_fn, loss_fn, budget="1GiB", global_batch=16)
    """
    import tempfile

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line
                for line in held.read().splitlines(keepends=True)
                if PROFILER_NOTE.encode() not in line
            ]
            if kept:
                os.write(2, b"".join(kept))


def pick_device(name: str | None) -> torch.device:
    """``--device``'s value, checked to be a device this machine has; without one, cuda
    when it is available and cpu otherwise. A usage error names what is wrong.

    Example::

        pick_device("cpu")    # device(type='cpu')
        pick_device("meta")   # UsageError: meta tensors hold no data ...
    """
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device name; use cpu or cuda") from None
    if device.type == "meta":
        raise UsageError(
            "--device meta: meta tensors hold no data, so nothing can be trained or "
            "measured there; use cpu or cuda"
        )
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"--device {name}: no CUDA device is available here; use cpu")
        if device.index is not None and device.index >= count:
            raise UsageError(
                f"--device {name}: this machine has {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}"
            )
        return device
    try:  # any other kind (mps, xpu, ...): usable when a tensor can be made there
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise UsageError(f"--device {name}: not usable here ({exc}); use cpu or cuda") from None
    return device


def to_device(batch: Any, device: torch.device) -> Any:
    """:func:`memfit.nested.to_device`, imported when first called (building the parser
    imports no torch).

    Example::

        batch = to_device({"x": torch.zeros(4, 3), "note": "a"}, torch.device("cpu"))
    """
    from memfit.nested import to_device as move

    return move(batch, device)


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
        out[key] = typed_value(text, getattr(defaults, key), item, key)
    return out


def typed_value(text: str, current: Any, item: str, key: str) -> Any:
    """``text`` as a value of ``current``'s type (bool, int, float, a tuple of ints, else
    the text), for the ``--set`` item ``item``; a UsageError names what it needs.

    Example::

        typed_value("0.1", 0.0, "dropout=0.1", "dropout")  # 0.1
    """
    try:
        if isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, tuple):
            return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--set {item!r}: {key} needs a {type(current).__name__}") from None
    return text


def load_factory(spec: str, example: str) -> Any:
    """The function named by ``--factory MODULE:FUNCTION`` (the current directory is
    importable), or a UsageError that says what was wrong; ``example`` is shown as the
    form to write.

    Example::

        build = load_factory("mypkg.models:build", "mypkg.models:build")
    """
    module_name, sep, func_name = spec.rpartition(":")
    if not sep or not module_name or not func_name:
        raise UsageError(
            f"--factory {spec!r}: write MODULE:FUNCTION or path/to/file.py:FUNCTION, e.g. {example}"
        )
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        module = _module_from_file(spec, Path(module_name))
    else:
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UsageError(f"--factory {spec!r}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise UsageError(f"--factory {spec!r}: {module_name} has no function {func_name!r}")
    return factory


def _module_from_file(spec: str, path: Path) -> Any:
    """The module ``path`` (a ``.py`` file) defines, run as ``__main__`` is not: under its
    file's stem, with its directory importable (for its own imports)."""
    import importlib.util

    if not path.is_file():
        raise UsageError(f"--factory {spec!r}: no such file {str(path)!r}")
    module_spec = importlib.util.spec_from_file_location(f"memfit_factory_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"--factory {spec!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[module_spec.name] = module
    try:
        module_spec.loader.exec_module(module)
    except ImportError as exc:
        raise UsageError(f"--factory {spec!r}: {path} cannot be imported ({exc})") from None
    return module


def load_workload(spec: str) -> Workload:
    """The :class:`Workload` that ``--factory MODULE:FUNCTION``'s ``FUNCTION()`` returns,
    or a UsageError that says what to write.

    The tuples the subcommands took before keep working for one release, with a
    DeprecationWarning: ``(model, batch)`` or ``(model, batch, loss_fn)`` (``memfit
    plan``'s; a built model and one batch), and ``(model_fn, batch_fn)`` or ``(model_fn,
    batch_fn, loss_fn)`` (``memfit estimate``'s and ``memfit tune``'s).

    Example::

        workload = load_workload("mypkg.models:workload")
        model = workload.model_fn()
    """
    made = load_factory(spec, "mypkg.models:workload")()
    if isinstance(made, Workload):
        return made
    if not (isinstance(made, tuple) and len(made) in (2, 3)):
        raise UsageError(
            f"--factory {spec}: must return a memfit.Workload(model_fn, batch_fn, loss_fn), "
            f"got {type(made).__name__}"
        )
    from torch import nn

    if isinstance(made[0], nn.Module):  # memfit plan's: a built model and one batch
        model, batch = made[0], made[1]
        shape = "(model, batch, loss_fn)" if len(made) == 3 else "(model, batch)"
        workload = Workload(lambda: model, lambda _: batch, *made[2:])
    else:
        shape = "(model_fn, batch_fn, loss_fn)" if len(made) == 3 else "(model_fn, batch_fn)"
        workload = Workload(*made)
    # A DeprecationWarning from a library is hidden by default; on the command line it is
    # the one place the user learns of it, so it is shown unless -W says otherwise.
    with warnings.catch_warnings():
        if not sys.warnoptions:
            warnings.simplefilter("always", DeprecationWarning)
        warn_renamed(
            f"--factory {spec} returning a tuple {shape}",
            "a memfit.Workload(model_fn=..., batch_fn=..., loss_fn=...)",
        )
    return workload


def factory_model(
    spec: str, *, device: torch.device, seed: int
) -> tuple[Any, Callable[[Any, Any], Any], Callable[..., Any]]:
    """``(model, loss_fn, batch_fn)`` of ``--factory``'s :class:`Workload`, in the form of
    :func:`builtin_model`'s, for ``memfit train``: ``model_fn()`` built after
    ``torch.manual_seed(seed)`` and moved to ``device``; ``loss_fn`` the workload's (the
    sum of the output without one); ``batch_fn(n, generator=None, split="train")`` calls
    ``workload.batch_fn(n)`` with torch's random generator seeded by ``generator`` (and
    restored after), so the batch of every step, and of a resumed run, is the same one
    (``split`` is not the workload's concern: validation draws with its own seeds).

    Example::

        model, loss_fn, batch_fn = factory_model("examples/my_model.py:build",
                                                 device=torch.device("cpu"), seed=0)
    """
    import random

    import torch

    from memfit.checkpoint.api import default_step_loss

    workload = load_workload(spec)
    random.seed(seed)
    torch.manual_seed(seed)
    model = workload.model_fn()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"--factory {spec}: model_fn() must return a torch.nn.Module, got "
            f"{type(model).__name__}"
        )
    model = model.to(device)

    def batch_fn(n: int, generator: int | None = None, split: str = "train") -> Any:
        del split
        if generator is None:
            return to_device(workload.batch_fn(n), device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(generator)
            return to_device(workload.batch_fn(n), device)

    return model, workload.loss_fn or default_step_loss, batch_fn


def builtin_model(
    name: str, overrides: dict[str, Any], *, data: str | None, device: torch.device, seed: int
) -> BuiltModel:
    """``(model, loss_fn, batch_fn)`` of the built-in model ``name``, its weights drawn
    after ``torch.manual_seed(seed)``. Python's ``random`` is seeded too, so every random
    generator of a run starts from its seed (and a run saved and resumed equals an
    uninterrupted one in all of them)."""
    import random

    import torch

    from memfit.models import build_model

    random.seed(seed)
    torch.manual_seed(seed)
    return build_model(name, data=data, device=device, **overrides)
