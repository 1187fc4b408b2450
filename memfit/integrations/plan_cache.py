"""Plans kept across runs: a callback that planned a model once reads the plan back.

Planning at train begin profiles the step, solves and measures the plan (seconds to tens
of seconds). The next run of the same training (the same model code and shapes, batch
shapes, loss, optimizer settings, budget, strategy, precision, loop order, machine kind
and library versions) gets the same plan (the callbacks weigh recompute by counted FLOPs
and bytes), so the plan and what was measured under it are written to a small JSON file
named by a digest of all of those (:func:`plan_key`), and read back instead.

The key hashes the source of every module's class (its ``forward``, a LightningModule's
``training_step``) and of the loss function, so a changed model reads no stale plan; what it cannot see (a global flag the forward reads)
is what ``plan_cache=None`` is for. A damaged or foreign file is ignored with a warning
and planned again; a directory that cannot be written is warned about once, and training
goes on.

Example::

    key = plan_key(model, batch, loss_fn, settings)
    cached = read_cached(cache_dir, key)       # None on a miss
    write_cached(cache_dir, key, CachedPlan(plan, measured, flops))
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import marshal
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.plan import Plan
from memfit.data.text import default_cache_dir
from memfit.errors import PlanError
from memfit.nested import tensors
from memfit.version import __version__

log = logging.getLogger("memfit.integrations")

#: Bumped when the file's fields change: older files are then misses.
FORMAT = 1


@dataclass(frozen=True)
class CachedPlan:
    """What a callback keeps of a planned run: the plan and what was measured under it."""

    plan: Plan
    measured_peak_bytes: float | None
    """The plan's step as measured on the example batch when it was made (None: not
    measured)."""
    step_flops: float
    """FLOPs of one unplanned forward and backward (the recompute overhead's base)."""


def cache_dir(setting: str | os.PathLike[str] | None) -> Path | None:
    """The directory plans are kept in: ``"auto"`` is ``$MEMFIT_PLAN_CACHE`` when set, else
    ``plans/`` under memfit's cache (``$MEMFIT_CACHE`` or ``~/.cache/memfit``); a path is
    itself; None keeps none.

    >>> cache_dir(None) is None
    True
    """
    if setting is None:
        return None
    if str(setting) == "auto":
        env = os.environ.get("MEMFIT_PLAN_CACHE")
        return Path(env).expanduser() if env else default_cache_dir() / "plans"
    return Path(setting).expanduser()


def _source_digest(obj: Any) -> str:
    """A digest of the source of a function or a class (a module class's ``forward``,
    ``training_step`` and the rest), or of its compiled code where there is no source."""
    try:
        return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        pass
    # No source file (code run with exec, a notebook without its cells): the compiled code
    # of the function, or of the class's functions, tells a change as well.
    functions = [obj] if hasattr(obj, "__code__") else list(getattr(obj, "__dict__", {}).values())
    digest = hashlib.sha256(
        f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}".encode()
    )
    for f in functions:
        code = getattr(f, "__code__", None)
        if code is not None:
            digest.update(marshal.dumps(code))
    return digest.hexdigest()[:16]


@functools.cache
def _library_digest() -> str:
    """A digest of memfit's own source: a plan made by other planner code is not reused,
    whatever the version string says."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _batch_signature(batch: Any) -> list[Any]:
    """The batch's tensors' shapes and dtypes, in order."""
    return [[list(t.shape), str(t.dtype)] for t in tensors(batch)]


def plan_key(model: nn.Module, batch: Any, loss_fn: Any, settings: dict[str, Any]) -> str:
    """The digest that names a plan's file: the model's structure, parameters and the
    source of its modules' classes, the batch's shapes and dtypes, the loss's source,
    the planning ``settings`` (budget, strategy, precision, ...), the machine's kind and
    the library versions.

    Example::

        plan_key(model, batch, loss_fn, {"budget": 2**30, "strategy": "optimal"})
    """
    forwards: dict[str, str] = {}
    modules = []
    for name, module in model.named_modules():
        cls = type(module)
        qualified = f"{cls.__module__}.{cls.__qualname__}"
        if qualified not in forwards:
            forwards[qualified] = _source_digest(cls)
        modules.append([name, qualified])
    params = [
        [n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in model.named_parameters()
    ]
    buffers = [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    machine = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else torch.backends.cpu.get_cpu_capability()
    )
    fields = {
        "format": FORMAT,
        "memfit": [__version__, _library_digest()],
        "torch": torch.__version__,
        "machine": [device.type, machine],
        "modules": modules,
        "forwards": forwards,
        "params": params,
        "buffers": buffers,
        "batch": _batch_signature(batch),
        "loss": _source_digest(loss_fn),
        "settings": settings,
    }
    text = json.dumps(fields, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def read_cached(directory: Path | None, key: str) -> CachedPlan | None:
    """The plan kept under ``key``, or None (no directory, no file, or a file that is not
    one; the last with a warning)."""
    if directory is None:
        return None
    path = directory / f"{key}.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            return None
        measured = data["measured_peak_bytes"]
        return CachedPlan(
            Plan.from_json(data["plan"]),
            None if measured is None else float(measured),
            float(data["step_flops"]),
        )
    except (OSError, ValueError, KeyError, TypeError, PlanError) as exc:
        warnings.warn(
            f"ignoring the kept plan {path} ({type(exc).__name__}: {exc}); planning again "
            "and writing it anew",
            stacklevel=3,
        )
        return None


def write_cached(directory: Path | None, key: str, cached: CachedPlan) -> Path | None:
    """Keep ``cached`` under ``key`` (written whole or not at all); the file's path, or
    None where there is no directory or it cannot be written (warned about)."""
    if directory is None:
        return None
    path = directory / f"{key}.json"
    data = {
        "format": FORMAT,
        "plan": cached.plan.to_json(),
        "measured_peak_bytes": cached.measured_peak_bytes,
        "step_flops": cached.step_flops,
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        warnings.warn(
            f"could not keep the plan in {directory} ({exc}); the next run plans again. "
            "Pass plan_cache=<a writable directory>, or plan_cache=None to keep none",
            stacklevel=3,
        )
        return None
    log.info("memfit plan kept in %s", path)
    return path
