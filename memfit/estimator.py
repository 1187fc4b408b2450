"""What fits: a training step's memory estimated at any scale, without allocating it.

The model is built on the meta device (shapes and dtypes, no data) and the planner's own
stages run on it: the profiler runs the step on fake tensors
(:mod:`memfit.checkpoint.profiler`, ``FakeTensorMode``), so every saved tensor, input and
output is counted in bytes exactly as on a real step; the step memory
(:mod:`memfit.checkpoint.step_memory`) counts weights, gradients, optimizer state and the
optimizer step's temporaries (a shadow optimizer on fake tensors,
:func:`memfit.fake.optimizer_step_temp_bytes`); the solvers plan each strategy. Times are
counted from FLOPs and bytes (:func:`memfit.checkpoint.costs.counted_times`): a fake step's
times mean nothing, and counted ones make the plans the same on every machine.

What a fake step cannot see, and so no estimate counts: the kernels' own workspaces beyond
every tensor (a CPU convolution's unfold buffers, cuBLAS/cuDNN workspaces), a unit's
forward workspace in a rebuild, and the allocator's rounding and fragmentation. Units that
do other work when run again (a key/value cache) are not probed: no real forward runs.

Static bytes per parameter with AdamW (weights + gradients + optimizer, where the
optimizer part holds the fp32 masters of the ``*-master`` modes, as in ZeRO's count):

=============  =======  =====  =========  =====
precision      weights  grads  optimizer  total
=============  =======  =====  =========  =====
fp32           4        4      8          16
bf16-mixed     4        4      8          16
bf16-master    2        4      4 + 8      18
bf16-sr        2        2      8          12
=============  =======  =====  =========  =====

(``fp16-*`` as ``bf16-*``; plus one 4-byte step count per parameter tensor.) Gradients are
those of what the optimizer updates: the fp32 masters' in the master modes.

Example::

    est = memfit.estimate(lambda: GPT(GPTConfig(n_layer=48, n_embd=2048)),
                          lambda b: torch.randint(0, 256, (b, 129)), batch_size=8,
                          loss_fn=gpt_loss, precisions=["bf16-mixed"], device_memory="80GB")
    print(est.summary())
    est.row("bf16-mixed", "optimal").max_micro_batch
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.api import default_step_loss
from memfit.checkpoint.costs import UnitCost, counted_times
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.planner import PlanResult, check_activation_storage, solve_profile
from memfit.checkpoint.profile_stage import ModelProfile, profile_step
from memfit.checkpoint.profiler.runner import fake_run
from memfit.checkpoint.solvers import STRATEGIES as PLAN_STRATEGIES
from memfit.checkpoint.step_memory import RankLayout, ZeroGrad, static_bytes
from memfit.checkpoint.tree import find_units
from memfit.errors import BudgetError, ConfigError, MemfitError, PlanError
from memfit.interpolate import NotAffine, affine_profile
from memfit.nested import map_tensors
from memfit.precision.optimizer_state import for_rounded_weights, kept_as
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.speed import expand_precisions
from memfit.units import format_bytes, parse_bytes
from memfit.workload import Workload, unpack_workload

__all__ = ["STRATEGIES", "Estimate", "EstimateRow", "estimate"]

#: The strategies an estimate compares: no checkpointing, every unit, sqrt(n) segments,
#: and the least recompute that fits ``device_memory``. Those a plan can be made with, but
#: ``uniform``: a family of plans over its segment length ``k``, of which ``sqrt`` is the
#: one a comparison takes.
STRATEGIES: tuple[str, ...] = tuple(s for s in PLAN_STRATEGIES if s != "uniform")

#: The largest micro-batch :func:`estimate` tries when looking for the one that fits.
MAX_BATCH = 1 << 16

#: The batches whose profiles a batch search draws its guesses through.
LINE = (2, 4)

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class EstimateRow:
    """One precision and strategy: the step's predicted peak and what it is made of."""

    precision: str
    """The precision mode (resolved: ``"bf16-mixed"``, never an alias)."""
    strategy: str
    """``none``, ``full``, ``sqrt`` or ``optimal`` (at ``device_memory``)."""
    peak_bytes: float
    """The predicted peak of one training step (the larger of the activation phase's and
    the optimizer step's). For ``optimal`` when no plan fits: the least plan's peak."""
    parts: dict[str, float]
    """``params`` (weights and buffers as held), ``grads`` (of what the optimizer
    updates), ``optimizer`` (its state, and the fp32 masters of the master modes),
    ``temp`` (the optimizer step's temporaries, when that step is the peak) and
    ``activations`` (the rest of the peak: saved or rebuilt activations, the batch, the
    loss's tensors). They sum to ``peak_bytes``."""
    fits: bool | None
    """Whether ``peak_bytes`` fits ``device_memory``; None without one."""
    recompute_fraction: float
    """Recomputed FLOPs over the forward's FLOPs (0 for ``none``)."""
    max_micro_batch: int | None
    """The largest micro-batch whose step fits ``device_memory`` with this precision and
    strategy (0: not even one; None without ``device_memory``)."""
    plan: Plan | None = field(default=None, compare=False, repr=False)
    """The plan estimated (None for ``optimal`` when no plan fits); ``memfit.apply_plan``
    takes it for the real model."""

    def to_dict(self) -> dict[str, Any]:
        """The row as plain JSON values (without the plan)."""
        return {
            "precision": self.precision,
            "strategy": self.strategy,
            "peak_bytes": self.peak_bytes,
            "parts": dict(self.parts),
            "fits": self.fits,
            "recompute_fraction": self.recompute_fraction,
            "max_micro_batch": self.max_micro_batch,
        }


@dataclass(frozen=True)
class Estimate:
    """What :func:`estimate` found: one row per precision and strategy."""

    rows: list[EstimateRow]
    batch_size: int
    """The micro-batch the rows' peaks are for."""
    device_memory: int | None
    """The memory rows are fitted to (bytes), or None."""
    parameters: int
    """Parameter elements of the model."""
    accumulation_steps: int = 1

    def row(self, precision: str, strategy: str) -> EstimateRow:
        """The row of ``precision`` (a mode or alias) and ``strategy``.

        Example::

            est.row("bf16-mixed", "optimal").peak_bytes
        """
        mode = PrecisionPolicy.of(precision).mode
        for r in self.rows:
            if r.precision == mode and r.strategy == strategy:
                return r
        have = ", ".join(sorted({f"{r.precision}/{r.strategy}" for r in self.rows}))
        raise ConfigError(f"no row for precision {mode!r} and strategy {strategy!r}; have: {have}")

    def to_dict(self) -> dict[str, Any]:
        """The estimate as plain JSON values."""
        return {
            "batch_size": self.batch_size,
            "accumulation_steps": self.accumulation_steps,
            "device_memory": self.device_memory,
            "parameters": self.parameters,
            "rows": [r.to_dict() for r in self.rows],
        }

    def to_json(self) -> str:
        """The estimate as a JSON document."""
        return json.dumps(self.to_dict(), indent=2)

    def summary(self, rich: bool = True) -> str:
        """The rows as a table: rendered by ``rich`` (plain text, no colour codes), or with
        ``rich=False`` in fixed-width columns.

        Example::

            print(est.summary())
        """
        head = ["precision", "strategy", "peak", "params", "grads", "optimizer"]
        head += ["activations", "optimizer temp", "recompute", "fits", "max batch"]
        body = [
            [
                r.precision,
                r.strategy,
                format_bytes(r.peak_bytes),
                *(format_bytes(r.parts[k]) for k in ("params", "grads", "optimizer")),
                format_bytes(r.parts["activations"]),
                # Only where the optimizer step is the peak; elsewhere it is not in the peak.
                format_bytes(r.parts["temp"]) if r.parts["temp"] else "-",
                f"{r.recompute_fraction:.0%}",
                "-" if r.fits is None else ("yes" if r.fits else "no"),
                "-" if r.max_micro_batch is None else str(r.max_micro_batch),
            ]
            for r in self.rows
        ]
        memory = "" if self.device_memory is None else f" on {format_bytes(self.device_memory)}"
        title = (
            f"{self.parameters / 1e6:,.1f}M parameters, micro-batch {self.batch_size}"
            f"{f' x {self.accumulation_steps}' if self.accumulation_steps > 1 else ''}{memory}"
        )
        if rich:
            return rich_table(title, head, body)
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        lines = [title] + [
            "  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [head, *body]
        ]
        return "\n".join(line.rstrip() for line in lines)


def rich_table(title: str, head: list[str], body: list[list[str]]) -> str:
    """``body`` under ``head`` as a table rendered by ``rich`` to plain text (no colour
    codes): the first two columns left-aligned, the rest right-aligned."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, name in enumerate(head):
        table.add_column(name, justify="left" if i < 2 else "right")
    for line in body:
        table.add_row(*line)
    console = Console(width=160, record=True, color_system=None, file=_Discard())
    console.print(table)
    return console.export_text().rstrip()


class _Discard:
    """A file that drops what is written (the table is exported, not printed)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def trained_optimizer(
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer | None],
    model: nn.Module,
    policy: PrecisionPolicy,
) -> torch.optim.Optimizer | None:
    """``optimizer_fn``'s optimizer over ``model`` as the Engine trains it under ``policy``:
    in ``bf16-sr``, memfit's step with stochastic rounding and at least fp32 moments
    (:func:`~memfit.precision.optimizer_state.for_rounded_weights`).

    Example::

        trained_optimizer(torch.optim.AdamW, meta_model(model_fn), PrecisionPolicy("bf16-sr"))
    """
    optimizer = optimizer_fn(model.parameters())
    return for_rounded_weights(optimizer) if policy.rounded_weights else optimizer


@dataclass
class Estimator:
    """Builds the meta model once per precision and profiles it per batch size (cached)."""

    model_fn: Callable[[], nn.Module]
    inputs_fn: Callable[[int], Any]
    loss_fn: LossFn
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer | None]
    accumulation_steps: int
    layout: RankLayout
    models: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]] = field(default_factory=dict)
    profiles: dict[tuple[str, int], ModelProfile] = field(default_factory=dict)
    solved: dict[tuple[str, int, str, int | None, bool], PlanResult | BudgetError] = field(
        default_factory=dict
    )
    zero_grad: ZeroGrad = "before_forward"
    """Where the step frees the gradients: ``"in_backward"`` when they are released."""
    activation_storage: tuple[str, ...] = ("keep", "recompute")
    """What ``optimal`` may do with a unit's saved tensors (:func:`estimate`)."""
    forwards: dict[tuple[str, int], Callable[[], Any]] = field(default_factory=dict)
    """Each profiled step's loss on its meta batch, which the storage's codes are
    counted on (kept apart: a profile drawn on a line has no step of its own)."""

    def model(self, policy: PrecisionPolicy) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if policy.mode not in self.models:
            model = meta_model(self.model_fn)
            self.models[policy.mode] = (model, trained_optimizer(self.optimizer_fn, model, policy))
        return self.models[policy.mode]

    def profiled(self, policy: PrecisionPolicy, batch_size: int) -> ModelProfile:
        key = (policy.mode, batch_size)
        if key not in self.profiles:
            model, _ = self.model(policy)
            inputs = map_tensors(self.inputs_fn(batch_size), _as_meta)
            try:
                prof = profile_step(model, inputs, self.loss_fn, policy, _units(model))
            except MemfitError:
                raise
            except Exception as exc:
                raise _fake_error("running its training step", exc) from exc
            # Nothing real can run on the meta model: no measured fallback (run_loss).
            self.profiles[key] = dataclasses.replace(
                prof, root=counted_times(prof.root), run_loss=None, counted=True
            )
            self.forwards[key] = functools.partial(_fake_loss, model, inputs, self.loss_fn, policy)
        return self.profiles[key]

    def line(self, policy: PrecisionPolicy) -> tuple[ModelProfile, ModelProfile]:
        """The profiles at batches 2 and 4, through which a search draws its guesses."""
        return self.profiled(policy, LINE[0]), self.profiled(policy, LINE[1])

    def searched(self, policy: PrecisionPolicy, batch_size: int) -> ModelProfile:
        """The profile a search's guess uses: profiled where it was, else on the line."""
        if batch_size <= LINE[1] or (policy.mode, batch_size) in self.profiles:
            return self.profiled(policy, batch_size)
        return affine_profile(*self.line(policy), batch_size, *LINE)

    def solve(
        self,
        policy: PrecisionPolicy,
        batch_size: int,
        strategy: str,
        budget: int | None,
        searching: bool = False,
    ) -> PlanResult:
        budget = budget if strategy == "optimal" else None
        key = (policy.mode, batch_size, strategy, budget, searching)
        if key not in self.solved:
            model, optimizer = self.model(policy)
            if searching:
                prof = self.searched(policy, batch_size)
            else:
                prof = self.profiled(policy, batch_size)
                stepped = self.forwards.get((policy.mode, batch_size))
                if len(self.activation_storage) > 2 and stepped is not None:
                    prof = dataclasses.replace(prof, run_loss=stepped)
            try:
                self.solved[key] = solve_profile(
                    model,
                    prof,
                    policy,
                    optimizer,
                    strategy,
                    budget,
                    self.accumulation_steps,
                    frontier=False,
                    layout=self.layout,
                    zero_grad=self.zero_grad,
                    activation_storage=self.activation_storage,
                )
            except BudgetError as exc:
                self.solved[key] = exc
        found = self.solved[key]
        if isinstance(found, BudgetError):
            raise found
        return found

    def fits(
        self,
        policy: PrecisionPolicy,
        batch_size: int,
        strategy: str,
        budget: int,
        searching: bool = False,
    ) -> bool:
        try:
            result = self.solve(policy, batch_size, strategy, budget, searching)
        except BudgetError:
            return False
        return result.plan.predicted_peak_bytes <= budget

    def max_micro_batch(self, policy: PrecisionPolicy, strategy: str, budget: int) -> int:
        """The largest batch that fits ``budget`` (the peak grows with the batch, so what
        fits is a prefix of the batch sizes).

        Two searches, each galloping (steps doubling) from a first batch to one that fits
        and one that does not, then bisecting between them. The first probes profiles drawn
        on the line through the profiles of batches 2 and 4 (:mod:`memfit.interpolate`: a solve
        each, no fake step) and finds a guess; the second starts at the guess with a step
        of 1 and probes real fake steps, which a good guess ends in two."""
        if not self.fits(policy, 1, strategy, budget):
            return 0

        def guessed(b: int) -> bool:
            return self.fits(policy, b, strategy, budget, searching=True)

        try:
            guess = _largest(guessed, *self._linear_guess(policy, strategy, budget))
        except NotAffine:  # the profiles differ in structure: no line to draw
            guess = 1
        return _largest(lambda b: self.fits(policy, b, strategy, budget), guess, 1)

    def _linear_guess(self, policy: PrecisionPolicy, strategy: str, budget: int) -> tuple[int, int]:
        """A first batch and step: where the line through the peaks of batches 2 and 4
        meets ``budget`` (``optimal`` drawn through ``full``'s peaks, its least plan's
        nearest stand-in)."""
        drawn = "full" if strategy == "optimal" else strategy
        low, high = (self.solve(policy, b, drawn, None).plan.predicted_peak_bytes for b in LINE)
        if high <= low:  # the optimizer step is the peak at both: no slope to draw
            return LINE[1], 1
        slope = (high - low) / (LINE[1] - LINE[0])
        probe = max(1, LINE[0] + int((budget - low) // slope))
        return probe, max(1, probe // 16)


def _fake_loss(
    model: nn.Module, inputs: Any, loss_fn: LossFn, policy: PrecisionPolicy
) -> torch.Tensor:
    """The step's loss on fake tensors, under the precision's autocast (meta tensors
    cannot autocast): what a storage's codes are counted on."""
    with fake_run(model, inputs, None) as (fakes, _, device), policy.autocast(device.type):
        return loss_fn(model, fakes)


def _largest(fits: Callable[[int], bool], probe: int, step: int) -> int:
    """The largest batch in ``1 .. MAX_BATCH`` for which ``fits`` holds, given that it holds
    for 1 and for a prefix: gallop from ``probe`` (steps from ``step``, doubling) to a batch
    that fits and one that does not, then bisect."""
    probe = min(MAX_BATCH, max(1, probe))
    if fits(probe):
        low = probe
        while True:
            if low >= MAX_BATCH:
                return MAX_BATCH
            nxt = min(MAX_BATCH, low + step)
            if not fits(nxt):
                high = nxt
                break
            low, step = nxt, 2 * step
    else:
        high = probe
        while True:
            nxt = high - step
            if nxt <= 1:
                low = 1
                break
            if fits(nxt):
                low = nxt
                break
            high, step = nxt, 2 * step
    while high - low > 1:  # low fits, high does not
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def estimate(
    model_fn: Callable[[], nn.Module] | Workload,
    inputs_fn: Callable[[int], Any] | None = None,
    loss_fn: LossFn | None = None,
    *,
    batch_size: int,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer | None] | None = None,
    precisions: Sequence[str] | None = None,
    strategies: Sequence[str] | None = None,
    accumulation_steps: int = 1,
    device_memory: str | int | None = None,
    world_size: int = 1,
    data_parallel: str | None = None,
    optimizer_state: str = "fp32",
    release_gradients: bool = False,
    activation_storage: Sequence[str] = ("keep", "recompute"),
) -> Estimate:
    """Estimate an ``Engine.train_step`` at every precision and strategy, on fake tensors.

    Args:
        model_fn: builds the model; it runs under ``torch.device("meta")``, so no weights
            are allocated (dtype casts are fine, moves to a device are not). Or a
            :class:`memfit.Workload`, which holds all three functions (its ``batch_fn`` is
            ``inputs_fn``): ``estimate(workload, batch_size=...)``, with no ``inputs_fn``
            or ``loss_fn`` beside it.
        inputs_fn: ``inputs_fn(batch_size)`` makes one micro-batch as ``Engine.train_step``
            takes it (a tensor, tuple or dict); real tensors are turned into meta ones of the
            same shape (build them small or on ``meta``).
        loss_fn: ``loss_fn(model, batch) -> scalar``, as the Engine, ``memfit.plan`` and
            ``memfit.tune`` take it; default: the sum of the first floating-point tensor of
            the model's output (``model(x)``, ``model(*x)``, ``model(**x)``).
        batch_size: the micro-batch size the rows are for.
        optimizer_fn: ``params -> optimizer`` (default ``torch.optim.AdamW``);
            ``lambda p: None`` for none.
        precisions: precision modes (default: fp32, bf16-mixed, bf16-master); ``"auto"``
            gives a row for each mode ``precision="auto"`` chooses between.
        strategies: a subset of :data:`STRATEGIES` (default: all).
        accumulation_steps: micro-batches per optimizer step (above 1 the gradients are
            held through the last one's forward and backward).
        device_memory: the memory to fit ("80GB", bytes); ``optimal`` plans for it, and
            each row says whether it fits and the largest micro-batch that does.
        world_size, data_parallel: estimate one rank of a data-parallel run (``"ddp"``,
            the default when ``world_size > 1``, or ``"fsdp"``: FSDP2 holds
            ``1/world_size`` of the weights, gradients and optimizer state;
            :meth:`~memfit.checkpoint.step_memory.RankLayout.of`); ``batch_size`` and
            ``device_memory`` are then per rank.
        optimizer_state: how the optimizer keeps its state, as ``Engine(optimizer_state=)``
            takes it: ``"fp32"`` (torch's own), ``"bf16"`` or ``"8bit"`` (docs/tiers.md).
        release_gradients: each update applied as its gradient is made in backward, as
            ``Engine(release_gradients=True)`` trains (no accumulation, one process).
        activation_storage: what ``optimal`` may do with a kept unit's saved tensors, as
            ``Engine(activation_storage=)`` takes it (e.g. ``("keep", "recompute",
            "fp8")``): the codes are counted on the meta step, and each storage's gradient
            error, which nothing fake can measure, is taken as within the tolerance (the
            plan made on the real model measures it and may refuse it).

    Raises:
        ConfigError: an unknown precision or strategy, a model that cannot be built or
            run on meta/fake tensors (the message says what failed), or a Workload given
            together with an ``inputs_fn`` or ``loss_fn``.

    Example::

        est = memfit.estimate(lambda: GPT(cfg), lambda b: torch.randint(0, 256, (b, 129)),
                              gpt_loss, batch_size=4, device_memory="24GB")
        print(est.summary())
        work = memfit.Workload(lambda: GPT(cfg), lambda b: torch.randint(0, 256, (b, 129)),
                               gpt_loss)
        est = memfit.estimate(work, batch_size=4, device_memory="24GB")  # the same rows
    """
    model_fn, inputs_fn, loss_fn = unpack_workload(
        model_fn, inputs_fn, loss_fn, call="memfit.estimate", batch_name="inputs_fn"
    )
    modes = [
        PrecisionPolicy(m)
        for m in expand_precisions(precisions or ("fp32", "bf16-mixed", "bf16-master"))
    ]
    chosen = list(strategies or STRATEGIES)
    for s in chosen:
        if s not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {s!r} for an estimate; valid: {', '.join(STRATEGIES)}"
            )
    if int(batch_size) != batch_size or batch_size < 1:
        raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ConfigError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    budget = None if device_memory is None else parse_bytes(device_memory, "cpu")

    est = Estimator(
        model_fn,
        inputs_fn,
        loss_fn or default_step_loss,
        kept_as(optimizer_fn or torch.optim.AdamW, optimizer_state),
        int(accumulation_steps),
        RankLayout.of(world_size, data_parallel),
        zero_grad="in_backward" if release_gradients else "before_forward",
        activation_storage=check_activation_storage(activation_storage),
    )
    rows: list[EstimateRow] = []
    parameters = 0
    for policy in modes:
        model, optimizer = est.model(policy)
        parameters = sum(p.numel() for p in model.parameters())
        fixed: dict[str, PlanResult] = {}
        for strategy in chosen:
            try:
                result: PlanResult | None = est.solve(policy, int(batch_size), strategy, budget)
            except BudgetError:
                result = None
            if result is not None and strategy != "optimal":
                fixed[strategy] = result
            if result is None:
                # No plan fits: the least of the fixed plans stands for the peak.
                result = min(
                    (est.solve(policy, int(batch_size), s, None) for s in ("full", "sqrt")),
                    key=lambda r: r.plan.predicted_peak_bytes,
                )
                plan = None
            else:
                plan = result.plan
            rows.append(
                row_of(
                    policy,
                    strategy,
                    result,
                    model,
                    optimizer,
                    budget,
                    plan,
                    None if budget is None else est.max_micro_batch(policy, strategy, budget),
                    est.layout,
                )
            )
    return Estimate(rows, int(batch_size), budget, parameters, int(accumulation_steps))


def row_of(
    policy: PrecisionPolicy,
    strategy: str,
    result: PlanResult,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    budget: int | None,
    plan: Plan | None,
    max_batch: int | None,
    layout: RankLayout,
) -> EstimateRow:
    """One estimate's row: a plan's predicted peak split by kind, its FLOPs and recompute,
    the largest micro-batch when it was searched.

    Example::

        row = row_of(policy, "optimal", result, model, optimizer, budget, result.plan, None,
                     RankLayout())
    """
    mem = result.memory
    peak = float(result.plan.predicted_peak_bytes)
    parts = static_parts(model, policy, optimizer, layout, result.profile.root)
    parts["grads"] = float(mem.grad_bytes)
    # The optimizer step's temporaries count where that step is the peak.
    at_optimizer = peak <= mem.optimizer_phase_bytes
    parts["temp"] = float(mem.optimizer_temp_bytes) if at_optimizer else 0.0
    parts["activations"] = max(0.0, peak - sum(parts.values()))
    forward = result.profile.root.fwd_flops
    return EstimateRow(
        precision=policy.mode,
        strategy=strategy,
        peak_bytes=peak,
        parts={k: parts[k] for k in ("params", "grads", "optimizer", "activations", "temp")},
        fits=None if budget is None else (plan is not None and peak <= budget),
        recompute_fraction=float(result.plan.recompute_flops / forward) if forward else 0.0,
        max_micro_batch=max_batch,
        plan=plan,
    )


def static_parts(
    model: nn.Module,
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer | None,
    layout: RankLayout | None = None,
    root: UnitCost | None = None,
) -> dict[str, float]:
    """:func:`~memfit.checkpoint.step_memory.static_bytes` as an estimate's row shows
    them: the weights and buffers as training holds them (``params``) and the optimizer's
    state with the fp32 masters of the master modes (``optimizer``), on one rank of
    ``layout`` (``root``: the unit tree, which names FSDP2's gathered blocks).

    Example::

        static_parts(model, PrecisionPolicy.of("bf16-master"), torch.optim.AdamW(model.parameters()))
        # {'params': 2 * n, 'optimizer': 12 * n + 4 * tensors}
    """
    static = static_bytes(model, policy, optimizer, layout, root)
    return {
        "params": float(static.params + static.buffers),
        "optimizer": float(static.masters + static.optimizer_state),
    }


def meta_model(model_fn: Callable[[], nn.Module]) -> nn.Module:
    """``model_fn()`` built under the meta device; a ConfigError that says what to change
    when it fails there or makes tensors on a real device."""
    try:
        with torch.device("meta"):
            model = model_fn()
    except MemfitError:
        raise
    except Exception as exc:
        raise _fake_error("building it", exc) from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model_fn must return an nn.Module, got {type(model).__name__}")
    if any(t.device.type != "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ConfigError(
            "model_fn made tensors on a real device; build the model without moving it "
            "(no .to(device) or device=...), so it lands on the meta device"
        )
    return model


def _units(model: nn.Module) -> list[str] | None:
    """The candidate units ``find_units`` finds; a model with none (a single layer) is
    estimated as one unit, so ``full`` recomputes it whole and ``sqrt`` nothing."""
    try:
        find_units(model)
    except PlanError:
        return []
    return None


def _as_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "meta" else torch.empty_like(t, device="meta")


def _fake_error(doing: str, exc: Exception) -> ConfigError:
    return ConfigError(
        f"the model failed on meta/fake tensors while {doing}: {type(exc).__name__}: {exc}. "
        "Estimates build the model without data, so code that reads tensor values (.item(), "
        "data-dependent shapes, a real device) cannot run; estimate a smaller real instance "
        "with memfit.measure or memfit.plan instead, or make model_fn avoid that code"
    )
