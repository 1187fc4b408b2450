"""The capacity view: for a family of model sizes and one device's memory, the largest model
and the largest batch that fit under each precision and checkpoint strategy.

Every number comes from :func:`memfit.estimator.estimate` (a meta model and fake tensors;
nothing is allocated), one model size at a time. A size whose weights, gradients and
optimizer state alone exceed the memory is not profiled: no batch can fit it.

The headline compares each precision and strategy with plain training (``fp32`` with no
checkpointing): how many times more parameters the largest model that fits has, and how
many times larger a micro-batch fits the reference model (the largest that plain training
fits at the batch size asked for).

Example::

    cap = memfit.capacity(
        lambda depth, width: GPT(GPTConfig(n_layer=depth, n_embd=width, n_head=width // 64,
                                           block_size=1024)),
        lambda b: torch.zeros(b, 1025, dtype=torch.long, device="meta"),
        sizes=[(12, 768), (24, 1024), (24, 2048), (32, 4096)],
        batch_size=8, device_memory="80GB", loss_fn=gpt_loss,
    )
    print(cap.summary())
    cap.largest_model("bf16-mixed", "full").parameters
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from memfit.checkpoint.planner import storage_choices
from memfit.checkpoint.step_memory import RankLayout, static_bytes
from memfit.errors import ConfigError
from memfit.estimator import (
    STRATEGIES,
    LossFn,
    estimate,
    meta_model,
    rich_table,
    trained_optimizer,
)
from memfit.precision.optimizer_state import kept_as
from memfit.precision.policy import PrecisionPolicy
from memfit.units import format_bytes, parse_bytes

__all__ = ["BASELINE", "MEMORY_TIERS", "Capacity", "CapacityRow", "Combo", "Tiers", "capacity"]


class Combo(NamedTuple):
    """What a capacity's rows are grouped by: a precision, a strategy and the tiers."""

    precision: str
    strategy: str
    tiers: str = ""
    """:attr:`Tiers.name` (``""``: none)."""


#: What the headline compares with: plain fp32 training, no checkpointing, no tiers.
BASELINE = Combo("fp32", "none", "")
#: What ``capacity(memory_tiers=)`` takes: the optimizer state given alone, or every tier.
MEMORY_TIERS = ("none", "all")


@dataclass(frozen=True)
class Tiers:
    """What a row assumes beyond precision and checkpointing (docs/tiers.md): how the
    optimizer keeps its state, whether gradients are released in backward, the coded
    storage the ``optimal`` plan may keep activations in, and whether the loss is the
    chunked one (``capacity(chunked_loss_fn=...)``)."""

    optimizer_state: str = "fp32"
    release_gradients: bool = False
    activation_storage: str = ""
    """``""`` (keep or recompute only), ``"bf16"`` or ``"fp8"``."""
    chunked_loss: bool = False

    @property
    def name(self) -> str:
        """``""`` for none, else e.g. ``"8bit state + released grads + fp8 activations"``."""
        parts = [f"{self.optimizer_state} state"] if self.optimizer_state != "fp32" else []
        parts += ["released grads"] if self.release_gradients else []
        parts += [f"{self.activation_storage} activations"] if self.activation_storage else []
        parts += ["chunked loss"] if self.chunked_loss else []
        return " + ".join(parts)

    @property
    def storage_choices(self) -> tuple[str, ...]:
        """What the plan may do with a unit's saved tensors (``activation_storage=``)."""
        return storage_choices([self.activation_storage] if self.activation_storage else [])


#: The tiers ``memory_tiers="all"`` searches: each alone and all together (bf16 state lies
#: between fp32's and 8-bit's, so 8-bit stands for it; fp8 activations for bf16's); those
#: with the chunked loss only where ``capacity`` is given one.
ALL_TIERS = (
    Tiers(),
    Tiers("8bit"),
    Tiers("fp32", True),
    Tiers("fp32", False, "fp8"),
    Tiers("8bit", True),
    Tiers("8bit", True, "fp8"),
    Tiers(chunked_loss=True),
    Tiers("8bit", True, "fp8", chunked_loss=True),
)
#: The precisions ``memory_tiers="all"`` estimates when none are given.
TIER_PRECISIONS = ("fp32", "bf16-mixed", "bf16-sr")


@dataclass(frozen=True)
class CapacityRow:
    """One model size under one precision and strategy."""

    depth: int
    width: int
    parameters: int
    """Parameter elements of the model at this size."""
    precision: str
    strategy: str
    static_bytes: float
    """Weights, buffers, gradients and optimizer state (no plan changes them)."""
    peak_bytes: float | None
    """The step's predicted peak at the capacity's batch size; None where the static bytes
    alone exceed the memory (the size was not profiled)."""
    fits: bool
    """Whether a step at the capacity's batch size fits the memory."""
    max_micro_batch: int
    """The largest micro-batch that fits (0: not even one sample)."""
    tiers: str = ""
    """The memory tiers the row assumes (:attr:`Tiers.name`; ``""``: none)."""

    @property
    def size(self) -> str:
        """``DEPTHxWIDTH``, e.g. ``32x4096``."""
        return f"{self.depth}x{self.width}"

    def to_dict(self) -> dict[str, Any]:
        """The row as plain JSON values."""
        return {
            "depth": self.depth,
            "width": self.width,
            "parameters": self.parameters,
            "precision": self.precision,
            "strategy": self.strategy,
            "static_bytes": self.static_bytes,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "max_micro_batch": self.max_micro_batch,
            "tiers": self.tiers,
        }


@dataclass(frozen=True)
class Capacity:
    """What :func:`capacity` found: a row per size, precision and strategy."""

    rows: list[CapacityRow]
    batch_size: int
    device_memory: int

    def combos(self) -> list[Combo]:
        """The (precision, strategy, tiers) of the rows, in the order they were estimated."""
        return list(dict.fromkeys(Combo(r.precision, r.strategy, r.tiers) for r in self.rows))

    def of(self, precision: str, strategy: str, tiers: str = "") -> list[CapacityRow]:
        """The rows of one precision, strategy and tiers, smallest model first."""
        mode = PrecisionPolicy.of(precision).mode
        found = [
            r
            for r in self.rows
            if r.precision == mode and r.strategy == strategy and r.tiers == tiers
        ]
        if not found:
            have = ", ".join("/".join(filter(None, c)) for c in self.combos())
            raise ConfigError(
                f"no rows for {'/'.join(filter(None, (mode, strategy, tiers)))}; have: {have}"
            )
        return sorted(found, key=lambda r: r.parameters)

    def largest_model(self, precision: str, strategy: str, tiers: str = "") -> CapacityRow | None:
        """The row of the largest model whose step at the batch size fits (None: none).

        Example::

            cap.largest_model("bf16-mixed", "full").size  # '32x4096'
            cap.largest_model("bf16-sr", "optimal", "8bit state + released grads")
        """
        fitting = [r for r in self.of(precision, strategy, tiers) if r.fits]
        return fitting[-1] if fitting else None

    def reference(self) -> CapacityRow | None:
        """The baseline's largest model: the size the batch comparison is made at (None
        when the baseline was not estimated or fits nothing, then the smallest size)."""
        if BASELINE not in self.combos():
            return None
        return self.largest_model(*BASELINE)

    def largest_batch(self, precision: str, strategy: str, tiers: str = "") -> int:
        """The largest micro-batch that fits the reference model (or, where the baseline
        fits nothing, the smallest size).

        Example::

            cap.largest_batch("bf16-mixed", "full")
        """
        ref = self.reference()
        rows = self.of(precision, strategy, tiers)
        if ref is None:
            return rows[0].max_micro_batch
        return next(r.max_micro_batch for r in rows if (r.depth, r.width) == (ref.depth, ref.width))

    def headline(self) -> list[dict[str, Any]]:
        """Per precision and strategy: the largest model and the largest batch, and each
        as a multiple of the baseline's (None where the baseline has none to divide by)."""
        base_model = self.largest_model(*BASELINE) if BASELINE in self.combos() else None
        base_batch = self.largest_batch(*BASELINE) if BASELINE in self.combos() else 0
        out = []
        for precision, strategy, tiers in self.combos():
            model = self.largest_model(precision, strategy, tiers)
            batch = self.largest_batch(precision, strategy, tiers)
            out.append(
                {
                    "precision": precision,
                    "strategy": strategy,
                    "tiers": tiers,
                    "largest_model": None if model is None else model.size,
                    "parameters": 0 if model is None else model.parameters,
                    "model_x": (
                        model.parameters / base_model.parameters
                        if model is not None and base_model is not None
                        else None
                    ),
                    "largest_batch": batch,
                    "batch_x": batch / base_batch if base_batch else None,
                }
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """The capacity as plain JSON values."""
        ref = self.reference()
        return {
            "batch_size": self.batch_size,
            "device_memory": self.device_memory,
            "reference": None if ref is None else ref.size,
            "headline": self.headline(),
            "rows": [r.to_dict() for r in self.rows],
        }

    def to_json(self) -> str:
        """The capacity as a JSON document."""
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        """Two tables: the headline, and the largest micro-batch of every size.

        Example::

            print(cap.summary())
        """
        ref = self.reference()
        memory = format_bytes(self.device_memory)
        tiered = any(r.tiers for r in self.rows)  # a tiers column only where there are any
        head = ["precision", "strategy", *(["tiers"] if tiered else [])]
        head += ["largest model", "params", "x plain"]
        head += [f"max batch at {ref.size if ref else 'smallest'}", "x plain"]
        body = [
            [
                h["precision"],
                h["strategy"],
                *([h["tiers"] or "-"] if tiered else []),
                h["largest_model"] or "none",
                _count(h["parameters"]),
                "-" if h["model_x"] is None else f"{h['model_x']:.1f}x",
                str(h["largest_batch"]),
                "-" if h["batch_x"] is None else f"{h['batch_x']:.1f}x",
            ]
            for h in self.headline()
        ]
        title = (
            f"What fits {memory} at micro-batch {self.batch_size} (plain: fp32, no checkpointing)"
        )
        first = rich_table(title, head, body)
        sizes = sorted({(r.parameters, r.size) for r in self.rows})
        grid_head = ["precision", "strategy", *(["tiers"] if tiered else [])]
        grid_head += [f"{s} ({_count(p)})" for p, s in sizes]
        grid = [
            [p, s, *([t or "-"] if tiered else [])]
            + [str(r.max_micro_batch) for r in self.of(p, s, t)]
            for p, s, t in self.combos()
        ]
        second = rich_table(f"Largest micro-batch that fits {memory}", grid_head, grid)
        return first + "\n\n" + second

    def plot(self, path: str | Path) -> Path:
        """The largest micro-batch against the model's parameters, a line per precision and
        strategy, with the batch size asked for marked; written as a PNG (needs
        matplotlib: ``pip install 'memfit[plot]'``).

        Example::

            cap.plot("capacity.png")
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            from matplotlib.ticker import EngFormatter
        except ImportError:
            raise ConfigError("plotting needs matplotlib: pip install 'memfit[plot]'") from None
        path = Path(path)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for precision, strategy, tiers in self.combos():
            rows = [r for r in self.of(precision, strategy, tiers) if r.max_micro_batch > 0]
            if rows:
                ax.plot(
                    [r.parameters for r in rows],
                    [r.max_micro_batch for r in rows],
                    marker="o",
                    label=", ".join(filter(None, (precision, strategy, tiers))),
                )
        ax.axhline(self.batch_size, color="grey", linestyle=":", label=f"batch {self.batch_size}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.set_xlabel("parameters")
        ax.set_ylabel("largest micro-batch that fits")
        ax.set_title(f"What fits {format_bytes(self.device_memory)}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def capacity(
    family: Callable[[int, int], nn.Module],
    inputs_fn: Callable[[int], Any],
    *,
    sizes: Sequence[tuple[int, int]],
    batch_size: int,
    device_memory: str | int,
    loss_fn: LossFn | None = None,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer | None] | None = None,
    precisions: Sequence[str] | None = None,
    strategies: Sequence[str] | None = None,
    world_size: int = 1,
    data_parallel: str | None = None,
    optimizer_state: str = "fp32",
    memory_tiers: str = "none",
    chunked_loss_fn: LossFn | None = None,
) -> Capacity:
    """The largest model and batch that fit ``device_memory``, per precision and strategy,
    over a family of sizes.

    Args:
        family: ``family(depth, width)`` builds the model of that size (run under the meta
            device, as :func:`memfit.estimator.estimate`'s ``model_fn``).
        inputs_fn: ``inputs_fn(batch_size)``, one micro-batch (the same for every size).
        sizes: the ``(depth, width)`` pairs to estimate.
        batch_size: the micro-batch a model must fit to count as fitting.
        device_memory: the memory to fit (``"80GB"``, bytes).
        loss_fn, optimizer_fn: as for :func:`memfit.estimator.estimate`.
        precisions: default ``fp32`` and ``bf16-mixed`` (``fp32`` is the baseline).
        strategies: default ``none``, ``full`` and ``optimal``.
        world_size, data_parallel: one rank of a data-parallel run (``"ddp"``, ``"fsdp"``),
            as :func:`memfit.estimator.estimate` takes them; the memory and the batch are
            then per rank, and under FSDP2 a model fits when its shard does.
        optimizer_state: the optimizer's state in ``"fp32"``, ``"bf16"`` or ``"8bit"``,
            as :func:`memfit.estimator.estimate` takes it.
        memory_tiers: ``"all"`` searches the memory tiers too (docs/tiers.md): each
            precision and strategy with the optimizer's state in fp32 and in 8 bits, its
            gradients kept and released in backward, activations kept in fp8 where the
            ``optimal`` plan needs it (:data:`ALL_TIERS`), and ``bf16-sr``
            among the default precisions; each row names its tiers (``tiers``), the
            baseline stays plain fp32. ``"none"``: ``optimizer_state`` alone.
        chunked_loss_fn: the same loss computed a piece of the tokens at a time, each
            piece recomputed in backward (the built-in GPT's
            :func:`~memfit.models.gpt.chunked_gpt_loss`); with ``memory_tiers="all"`` it
            is a tier too, alone and with all the others ("chunked loss").

    Raises:
        ConfigError: no sizes, a size that is not two positive ints, or what
            :func:`memfit.estimator.estimate` refuses.

    Example::

        cap = memfit.capacity(family, inputs_fn, sizes=[(12, 768), (24, 2048)],
                              batch_size=8, device_memory="80GB")
    """
    if not sizes:
        raise ConfigError("capacity needs at least one (depth, width) size")
    for size in sizes:
        if (
            not isinstance(size, tuple | list)
            or len(size) != 2
            or not all(isinstance(x, int) and x > 0 for x in size)
        ):
            raise ConfigError(f"a size is (depth, width) with positive ints, got {size!r}")
    memory = parse_bytes(device_memory, "cpu")
    if memory_tiers not in MEMORY_TIERS:
        raise ConfigError(f"memory_tiers takes 'none' or 'all', got {memory_tiers!r}")
    every = memory_tiers == "all"
    layout = RankLayout.of(world_size, data_parallel)  # refuses a bad kind or size here
    if every and layout.kind is not None:
        raise ConfigError(
            "memory_tiers='all' searches gradients released in backward, which a "
            "data-parallel run cannot release; estimate one process, or use "
            "optimizer_state= alone with world_size"
        )
    default_modes = TIER_PRECISIONS if every else ("fp32", "bf16-mixed")
    modes = [PrecisionPolicy.of(p).mode for p in (precisions or default_modes)]
    chosen = list(strategies or ("none", "full", "optimal"))
    for s in chosen:
        if s not in STRATEGIES:
            raise ConfigError(f"unknown strategy {s!r}; valid: {', '.join(STRATEGIES)}")
    tier_sets = ALL_TIERS if every else (Tiers(optimizer_state),)
    if chunked_loss_fn is None:
        tier_sets = tuple(t for t in tier_sets if not t.chunked_loss)
    rows: list[CapacityRow] = []
    for depth, width in sizes:

        def model_fn(depth: int = depth, width: int = width) -> nn.Module:
            return family(depth, width)

        for mode in modes:
            for tiers in tier_sets:
                rows += _rows(
                    model_fn,
                    (depth, width),
                    mode,
                    tiers,
                    chosen,
                    memory,
                    inputs_fn,
                    batch_size,
                    chunked_loss_fn if tiers.chunked_loss else loss_fn,
                    optimizer_fn,
                    layout,
                    world_size,
                    data_parallel,
                )
    return Capacity(rows, int(batch_size), memory)


def _rows(
    model_fn: Callable[[], nn.Module],
    size: tuple[int, int],
    mode: str,
    tiers: Tiers,
    strategies: list[str],
    memory: int,
    inputs_fn: Callable[[int], Any],
    batch_size: int,
    loss_fn: LossFn | None,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer | None] | None,
    layout: RankLayout,
    world_size: int,
    data_parallel: str | None,
) -> list[CapacityRow]:
    """One size's rows under one precision and set of tiers, a row per strategy."""
    make_optimizer = kept_as(optimizer_fn or torch.optim.AdamW, tiers.optimizer_state)
    static = _static_bytes(model_fn, PrecisionPolicy.of(mode), make_optimizer, layout, tiers)
    if static.bytes > memory:  # no batch fits; a fake step would only say so
        return [
            CapacityRow(*size, static.parameters, mode, s, static.bytes, None, False, 0, tiers.name)
            for s in strategies
        ]
    est = estimate(
        model_fn,
        inputs_fn,
        batch_size=batch_size,
        loss_fn=loss_fn,
        optimizer_fn=make_optimizer,
        precisions=[mode],
        strategies=strategies,
        device_memory=memory,
        world_size=world_size,
        data_parallel=data_parallel,
        release_gradients=tiers.release_gradients,
        activation_storage=tiers.storage_choices,
    )
    return [
        CapacityRow(
            *size,
            est.parameters,
            mode,
            r.strategy,
            r.parts["params"] + r.parts["grads"] + r.parts["optimizer"],
            r.peak_bytes,
            bool(r.fits),
            int(r.max_micro_batch or 0),
            tiers.name,
        )
        for r in est.rows
    ]


def _count(parameters: int) -> str:
    """``6.74B``, ``85.1M``: a parameter count as people say it."""
    if parameters >= 1e9:
        return f"{parameters / 1e9:.2f}B"
    return f"{parameters / 1e6:.1f}M"


@dataclass(frozen=True)
class _Static:
    parameters: int
    bytes: float


def _static_bytes(
    model_fn: Callable[[], nn.Module],
    policy: PrecisionPolicy,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer | None],
    layout: RankLayout,
    tiers: Tiers,
) -> _Static:
    """Weights, buffers, gradients, fp32 masters and optimizer state of the meta model
    (:func:`~memfit.checkpoint.step_memory.static_bytes`), on one rank of ``layout``;
    under FSDP2 without the gathered blocks (the model is not profiled), a lower bound.
    Released gradients are left out (one tensor's at a time: a lower bound too)."""
    model = meta_model(model_fn)
    static = static_bytes(model, policy, trained_optimizer(optimizer_fn, model, policy), layout)
    held = static.total_bytes - (static.grads if tiers.release_gradients else 0.0)
    return _Static(sum(p.numel() for p in model.parameters()), float(held))
