"""memfit.plan against the activation checkpointing users write today, measured by the allocator.

For each model (``bench/peer_models.py``: memfit's GPT, a chain of residual MLP blocks whose
widths differ 16x, and Hugging Face models built from configs, no weights downloaded) and
each precision:

* **no plan**: the step without checkpointing, measured, and predicted by ``memfit.plan``
  without a budget (which also gives memfit's (peak, recompute) frontier);
* **the peers**, each on its own copy of the model and optimizer: the peak of a whole
  training step (``zero_grad``, forward, backward, ``optimizer.step()``) as the allocator
  saw it (``memfit.allocator.allocator_peak``: torch.profiler's memory events, kernels'
  workspaces included), and its recompute FLOPs (``flop_counter``: the step's FLOPs less
  those of the step without checkpointing). The peers:

  - ``checkpoint_sequential(k)``: ``torch.utils.checkpoint.checkpoint_sequential`` with
    ``k = round(sqrt(n))`` segments over the ``n`` blocks (sequential stacks only: memfit's
    GPT and the chain; Hugging Face blocks take keyword arguments it cannot pass);
  - ``checkpoint per block``: every block's forward run by
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``;
  - ``HF reentrant`` and ``HF non-reentrant``: Hugging Face's
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ...})``;
  - ``selective (matmuls saved)``: torchtitan's selective activation checkpointing, every
    block checkpointed with ``context_fn=create_selective_checkpoint_contexts(policy)``
    whose policy saves the outputs of the matmuls (:data:`SAVED_OPS`) and recomputes the
    rest;

* **memfit at each peer's peak**: ``memfit.plan(..., budget=peer peak x 1.02)`` on a copy,
  applied, the step measured the same way: does it fit (measured <= budget), and its
  counted recompute FLOPs against the peer's; or the ``BudgetError`` that refused it;
* **memfit's least plan**: planned at the least peak of its frontier (divided by
  ``1 - RESERVE`` plus a byte, since the planner keeps ``RESERVE`` of a budget free), its
  predicted against its measured peak; and memfit's strategy ``full`` (every block
  recomputed on its own, no budget), predicted and measured, the plan closest to the
  per-block peers;
* **gradients** (fp32 runs): one seeded forward and backward of the model with the least
  plan (``full`` where it failed) and without, every parameter gradient compared bitwise (``torch.equal``), with the
  model's dropout on (memfit replays the random state in a rebuild).

Every measured step follows a warm-up step under the same checkpointing, on a copy of the
model made after one optimizer step, so the optimizer state exists and every variant starts
from the same weights. bf16-mixed runs forward under CPU autocast with memfit's fp32 islands
applied (``memfit.precision.apply_precision``), as ``bench/zoo.py`` does. A crash on a row
is recorded with its error and the run goes on; a model that fails to build is skipped with
its reason.

    python bench/peers.py --quick                   # memfit's GPT, the chain, GPT-2, Mixtral
    python bench/peers.py --json peers.json         # every model
    python bench/peers.py --models t5,swin --precision fp32,bf16-mixed
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from bench_meta import memfit_commit, run_meta  # bench/bench_meta.py
from peer_models import BUILDERS, LossFn, Subject  # bench/peer_models.py
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from zoo import count_flops, error_text, recomputed_units  # bench/zoo.py

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.planner import RESERVE
from memfit.errors import BudgetError
from memfit.units import format_bytes

PRECISIONS = ("fp32", "bf16-mixed")
#: memfit's budget at a peer: the peer's measured peak times this.
PEER_MARGIN = 1.02
#: What ``--quick`` runs.
QUICK_MODELS = ("gpt", "chain", "gpt2", "mixtral")


# ---------------------------------------------------------------------- one step, measured


def make_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: LossFn, precision: str
) -> Callable[[], None]:
    """One whole seeded training step; bf16-mixed runs forward under CPU autocast."""
    mixed = precision == "bf16-mixed"

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()

    return step


@dataclass(frozen=True)
class StepCost:
    """A measured training step."""

    peak_bytes: int
    """The allocator's peak of the step, what was alive at its start included."""
    flops: float
    """The FLOPs the step counted (forward, rebuilds, backward)."""


def measure(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: LossFn, precision: str
) -> StepCost:
    """The allocator's peak and the FLOPs of one step, after a warm-up step (bench/zoo.py's
    ``measure_step`` without the storage tracker, which this table does not show)."""
    step = make_step(model, optimizer, batch, loss_fn, precision)
    step()
    live = [*model.parameters(), *model.buffers(), *optimizer_tensors(optimizer), batch]
    peak = allocator_peak(step, live=live).peak_bytes
    return StepCost(int(peak), count_flops(step))


def fresh_copy(subject: Subject, precision: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A copy of the subject's model and optimizer (the optimizer holding the copy), with
    memfit's fp32 islands under a mixed precision."""
    model, optimizer = copy.deepcopy((subject.model, subject.optimizer))
    memfit.precision.apply_precision(model, memfit.PrecisionPolicy(precision))
    return model, optimizer


# ---------------------------------------------------------------------- the peers

#: The ops whose outputs the selective peer saves: matmuls and attention, as torchtitan's
#: selective activation checkpointing does (it saves every other ``mm``; here all).
SAVED_OPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(torch.ops.aten, name)
)


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective peer's policy: keep matmul and attention outputs, recompute the rest."""
    if op.overloadpacket in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks(blocks: list[nn.Module], selective: bool = False) -> None:
    """Run each block's forward under non-reentrant ``checkpoint``; ``selective``: with
    :func:`save_matmuls` as its policy."""
    context = (
        functools.partial(create_selective_checkpoint_contexts, save_matmuls) if selective else None
    )
    for block in blocks:
        forward = block.forward

        def checkpointed(*args: Any, _forward: Callable = forward, **kwargs: Any) -> Any:
            if context is None:
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context, **kwargs)

        block.forward = checkpointed


def hf_enable(model: nn.Module, reentrant: bool) -> None:
    """Hugging Face's own gradient checkpointing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed arguments in transformers 5
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )


@dataclass(frozen=True)
class Peer:
    """A way users checkpoint today: put on a copy of the model, it returns the loss
    function the step runs."""

    name: str
    applies: Callable[[Subject], bool]
    put_on: Callable[[nn.Module, Subject], LossFn]


def _sequential(model: nn.Module, subject: Subject) -> LossFn:
    assert subject.sequential_loss is not None
    return subject.sequential_loss(sqrt_segments(subject))


def _per_block(selective: bool) -> Callable[[nn.Module, Subject], LossFn]:
    def put_on(model: nn.Module, subject: Subject) -> LossFn:
        checkpoint_blocks(subject.blocks(model), selective=selective)
        return subject.loss_fn

    return put_on


def _hf(reentrant: bool) -> Callable[[nn.Module, Subject], LossFn]:
    def put_on(model: nn.Module, subject: Subject) -> LossFn:
        hf_enable(model, reentrant)
        return subject.loss_fn

    return put_on


def sqrt_segments(subject: Subject) -> int:
    """``round(sqrt(n))`` for ``n`` blocks: the segment count of Chen et al.'s rule."""
    return max(1, round(math.sqrt(len(subject.blocks(subject.model)))))


PEERS = (
    Peer("checkpoint_sequential(sqrt n)", lambda s: s.sequential_loss is not None, _sequential),
    Peer("checkpoint per block", lambda s: True, _per_block(selective=False)),
    Peer("HF reentrant", lambda s: s.is_hf, _hf(reentrant=True)),
    Peer("HF non-reentrant", lambda s: s.is_hf, _hf(reentrant=False)),
    Peer("selective (matmuls saved)", lambda s: True, _per_block(selective=True)),
)


# ---------------------------------------------------------------------- the rows


@dataclass
class MemfitRun:
    """``memfit.plan`` at a budget (or with a fixed strategy), applied and measured; or why
    it was refused."""

    budget_bytes: int | None
    strategy: str = "optimal"
    predicted_peak_bytes: float | None = None
    measured_peak_bytes: int | None = None
    fits: bool | None = None
    """measured <= budget (None without a budget)."""
    planned_recompute_flops: float | None = None
    recompute_flops: float | None = None
    """Counted: the step's FLOPs less those of the step without a plan."""
    units_recomputed: int | None = None
    refusal: str | None = None
    """The BudgetError's text, where memfit refused the budget."""
    error_pct: float | None = None
    """(predicted - measured) / measured, in percent."""
    error: str | None = None
    """Any other exception, with where it was raised."""


@dataclass
class PeerRow:
    """One peer's measured step, and memfit at its peak."""

    peer: str
    peak_bytes: int | None = None
    recompute_flops: float | None = None
    error: str | None = None
    memfit: MemfitRun | None = None
    same_budget_as: str | None = None
    """The earlier peer whose budget was the same (memfit's run is shared)."""


@dataclass
class GradientCheck:
    """memfit's least plan against no plan: one seeded fp32 forward and backward each."""

    params: int = 0
    differing: list[str] = field(default_factory=list)
    loss_equal: bool | None = None
    equal: bool | None = None
    dropout: bool = False
    error: str | None = None


@dataclass
class ModelReport:
    """Everything measured on one model at one precision."""

    model: str
    precision: str
    description: str = ""
    no_plan: StepCost | None = None
    no_plan_predicted_bytes: float | None = None
    frontier_least_bytes: float | None = None
    peers: list[PeerRow] = field(default_factory=list)
    least: MemfitRun | None = None
    """memfit at the least peak of its frontier (plus the reserve)."""
    full: MemfitRun | None = None
    """memfit's strategy ``full``: every block recomputed on its own, no budget."""
    gradients: GradientCheck | None = None
    error: str | None = None


# ---------------------------------------------------------------------- running it


def plan_and_measure(
    subject: Subject,
    precision: str,
    budget: int | None,
    base_flops: float,
    strategy: str = "optimal",
) -> tuple[MemfitRun, memfit.Plan | None]:
    """memfit's plan at ``budget`` (``strategy``) on a copy, applied, its step measured."""
    run = MemfitRun(budget_bytes=budget, strategy=strategy)
    model, optimizer = fresh_copy(subject, precision)
    try:
        plan = memfit.plan(
            model,
            subject.batch,
            subject.loss_fn,
            budget=budget,
            strategy=strategy,
            precision=precision,
            optimizer=optimizer,
        )
    except BudgetError as exc:
        run.refusal = str(exc)
        return run, None
    except Exception as exc:  # a crash is a finding: record it, go on
        run.error = error_text(exc)
        return run, None
    run.predicted_peak_bytes = float(plan.predicted_peak_bytes)
    run.planned_recompute_flops = float(plan.recompute_flops)
    run.units_recomputed = len(recomputed_units(plan))
    try:
        memfit.apply_plan(model, plan)
        cost = measure(model, optimizer, subject.batch, subject.loss_fn, precision)
    except Exception as exc:
        run.error = error_text(exc)
        return run, plan
    run.measured_peak_bytes = cost.peak_bytes
    run.error_pct = 100 * (run.predicted_peak_bytes - cost.peak_bytes) / cost.peak_bytes
    run.fits = None if budget is None else cost.peak_bytes <= budget
    run.recompute_flops = cost.flops - base_flops
    return run, plan


def peer_rows(subject: Subject, precision: str, base_flops: float) -> list[PeerRow]:
    """Every peer that applies to the subject, then memfit at its peak x PEER_MARGIN."""
    rows: list[PeerRow] = []
    by_budget: dict[int, str] = {}
    for peer in PEERS:
        if not peer.applies(subject):
            continue
        row = PeerRow(peer.name)
        rows.append(row)
        log(subject.name, precision, peer.name)
        try:
            model, optimizer = fresh_copy(subject, precision)
            loss_fn = peer.put_on(model, subject)
            cost = measure(model, optimizer, subject.batch, loss_fn, precision)
            row.peak_bytes = cost.peak_bytes
            row.recompute_flops = cost.flops - base_flops
            del model, optimizer
        except Exception as exc:
            row.error = error_text(exc)
            continue
        budget = int(row.peak_bytes * PEER_MARGIN)
        if budget in by_budget:  # the same budget plans the same: measured once
            row.same_budget_as = by_budget[budget]
            row.memfit = next(r.memfit for r in rows if r.peer == row.same_budget_as)
            continue
        by_budget[budget] = peer.name
        log(subject.name, precision, f"memfit @ {peer.name}")
        row.memfit, _ = plan_and_measure(subject, precision, budget, base_flops)
    return rows


def gradient_check(subject: Subject, plan: memfit.Plan) -> GradientCheck:
    """One seeded fp32 forward and backward of two copies of the model, one with ``plan``
    applied: are every parameter gradient and the loss bitwise equal?"""
    check = GradientCheck(dropout=subject.has_dropout)
    try:
        reference, planned = copy.deepcopy(subject.model), copy.deepcopy(subject.model)
        memfit.apply_plan(planned, plan)

        def run(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
            model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            loss = subject.loss_fn(model, subject.batch)
            loss.backward()
            return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

        loss_a, grads_a = run(reference)
        loss_b, grads_b = run(planned)
    except Exception as exc:
        check.error = error_text(exc)
        return check

    def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

    check.params = len(grads_a)
    check.differing = [n for n in grads_a if not same(grads_a[n], grads_b.get(n))]
    check.loss_equal = bool(torch.equal(loss_a, loss_b))
    check.equal = check.loss_equal and not check.differing
    return check


def model_report(subject: Subject, precision: str) -> ModelReport:
    """Every row of one model at one precision."""
    report = ModelReport(subject.name, precision, subject.describe())
    log(subject.name, precision, "no plan")
    try:
        model, optimizer = fresh_copy(subject, precision)
        whole = memfit.plan(
            model, subject.batch, subject.loss_fn, precision=precision, optimizer=optimizer
        )
        report.no_plan_predicted_bytes = float(whole.predicted_peak_bytes)
        report.frontier_least_bytes = float(min(p.peak_bytes for p in whole.frontier))
        report.no_plan = measure(model, optimizer, subject.batch, subject.loss_fn, precision)
        del model, optimizer
    except Exception as exc:
        report.error = error_text(exc)
        return report
    base_flops = report.no_plan.flops
    report.peers = peer_rows(subject, precision, base_flops)
    log(subject.name, precision, "memfit's least plan")
    # The least frontier peak, raised by the reserve the planner keeps free of a budget.
    least_budget = int(report.frontier_least_bytes / (1 - RESERVE)) + 1
    report.least, plan = plan_and_measure(subject, precision, least_budget, base_flops)
    log(subject.name, precision, "memfit strategy full")
    report.full, full_plan = plan_and_measure(subject, precision, None, base_flops, "full")
    plan = plan or full_plan  # the gradients of the least plan, else of full
    if precision == "fp32" and plan is not None:
        log(subject.name, precision, "gradients")
        report.gradients = gradient_check(subject, plan)
    return report


def log(model: str, precision: str, what: str) -> None:
    """Progress on stderr."""
    print(f"  {model:<8} {precision:<10} {what}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- the tables


def _b(n: float | None) -> str:
    return "–" if n is None else format_bytes(int(n))


def _exact(n: float | None) -> str:
    return "–" if n is None else f"{format_bytes(int(n))} ({int(n):,} B)"


def _gflop(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e9:.3f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:+.1f}%"


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _memfit_cells(run: MemfitRun | None, peer_flops: float | None) -> list[str]:
    """The memfit columns: budget, fits, predicted, measured, recompute GFLOP, vs the peer."""
    if run is None:
        return ["–"] * 6
    if run.measured_peak_bytes is None:
        kind = "**refused**" if run.refusal else "**error**"
        why = _short(run.refusal or run.error or "no measurement")
        return [_b(run.budget_bytes), f"{kind}: {why}", _b(run.predicted_peak_bytes), "–", "–", "–"]
    if peer_flops is None or run.recompute_flops is None:
        versus = "–"
    else:
        diff = run.recompute_flops - peer_flops
        versus = "=" if abs(diff) <= 0.005 * max(peer_flops, 1.0) else f"{diff / 1e9:+.3f}"
    return [
        _b(run.budget_bytes),
        {True: "yes", False: "**no**", None: "–"}[run.fits],
        _b(run.predicted_peak_bytes),
        f"{_b(run.measured_peak_bytes)} ({_pct(run.error_pct)})",
        _gflop(run.recompute_flops),
        versus,
    ]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render(report: ModelReport) -> str:
    """One model's markdown table."""
    lines = [f"### {report.model}, {report.precision}", "", report.description, ""]
    if report.error:
        lines.append(f"**error**: {report.error}")
        return "\n".join(lines)
    assert report.no_plan is not None
    lines += [
        f"No plan: measured {_b(report.no_plan.peak_bytes)}, predicted "
        f"{_b(report.no_plan_predicted_bytes)}; step {_gflop(report.no_plan.flops)} GFLOP; "
        f"memfit's frontier reaches down to {_b(report.frontier_least_bytes)} (predicted).",
        "",
        "| peer | peer peak | peer recompute GFLOP | memfit budget | memfit fits? "
        "| memfit predicted | memfit measured (prediction error) | memfit recompute GFLOP "
        "| memfit − peer GFLOP |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in report.peers:
        if row.error:
            lines.append(f"| {row.peer} | **error**: {_short(row.error)} | | | | | | | |")
            continue
        peer = row.peer + (f" (budget as {row.same_budget_as})" if row.same_budget_as else "")
        cells = [peer, _b(row.peak_bytes), _gflop(row.recompute_flops)]
        lines.append(_row(cells + _memfit_cells(row.memfit, row.recompute_flops)))
    for label, run in (
        ("memfit's least plan", report.least),
        ("memfit strategy full", report.full),
    ):
        if run is not None:
            lines.append(_row([f"**{label}**", "–", "–", *_memfit_cells(run, None)]))
    if report.gradients is not None:
        g = report.gradients
        if g.error:
            verdict = f"**error**: {g.error}"
        elif g.equal:
            verdict = f"bitwise equal ({g.params} parameter gradients and the loss)"
        else:
            verdict = (
                f"**differ**: {len(g.differing)}/{g.params} gradients "
                f"({', '.join(g.differing[:5])}), loss equal {g.loss_equal}"
            )
        dropout = "dropout on" if g.dropout else "no dropout"
        lines += ["", f"Gradients, least plan vs no plan (fp32, {dropout}): {verdict}."]
    return "\n".join(lines)


def findings(reports: list[ModelReport]) -> list[str]:
    """Every refusal, over-budget step, crash and unequal gradient, with its numbers."""
    out = []
    for r in reports:
        where = f"{r.model} {r.precision}"
        if r.error:
            out.append(f"{where}: crashed: {r.error}")
            continue
        least = r.least
        least_text = (
            f"memfit's least plan predicted {_exact(least.predicted_peak_bytes)}, measured "
            f"{_exact(least.measured_peak_bytes)}"
            if least is not None
            else "no least plan"
        )
        runs = [(f"memfit @ {p.peer}", p.memfit) for p in r.peers if not p.same_budget_as]
        runs += [("memfit's least plan", least), ("memfit strategy full", r.full)]
        for p in r.peers:
            if p.error:
                out.append(f"{where} peer {p.peer}: crashed: {p.error}")
        for label, run in runs:
            if run is None:
                continue
            if run.refusal:
                out.append(
                    f"{where} {label}: refused, budget {_exact(run.budget_bytes)}; "
                    f"{least_text}; {_short(run.refusal, 600)}"
                )
            if run.error:
                out.append(f"{where} {label}: crashed: {run.error}")
            if run.fits is False:
                over = run.measured_peak_bytes - run.budget_bytes
                out.append(
                    f"{where} {label}: over budget, measured {_exact(run.measured_peak_bytes)} "
                    f"> budget {_exact(run.budget_bytes)}, +{100 * over / run.budget_bytes:.2f}%; "
                    f"predicted {_exact(run.predicted_peak_bytes)}"
                )
        lowest = min(
            (run.measured_peak_bytes for run in (least, r.full) if run and run.measured_peak_bytes),
            default=None,
        )
        for p in r.peers:
            if lowest is not None and p.peak_bytes is not None and p.peak_bytes < lowest:
                full = r.full.measured_peak_bytes if r.full else None
                out.append(
                    f"{where} peer {p.peer} reached {_exact(p.peak_bytes)}, below memfit's "
                    f"least plan and strategy full ({least_text}; strategy full measured "
                    f"{_exact(full)})"
                )
        if r.gradients is not None and r.gradients.equal is False:
            out.append(f"{where}: gradients differ: {r.gradients.differing[:10]}")
        if r.gradients is not None and r.gradients.error:
            out.append(f"{where}: gradient check crashed: {r.gradients.error}")
    return out


def summary(reports: list[ModelReport]) -> str:
    """How often memfit met a peer's peak, and with how much recompute."""
    total = fits = refused = fewer = same = more = 0
    for r in reports:
        for p in r.peers:
            if p.memfit is None or p.peak_bytes is None:
                continue
            total += 1
            refused += p.memfit.refusal is not None
            if p.memfit.fits:
                fits += 1
                diff = p.memfit.recompute_flops - p.recompute_flops
                tol = 0.005 * max(p.recompute_flops, 1.0)
                fewer += diff < -tol
                same += abs(diff) <= tol
                more += diff > tol
    return (
        f"memfit at a peer's peak x {PEER_MARGIN}: {fits} of {total} fit "
        f"({fewer} with fewer recompute FLOPs than the peer, {same} the same, {more} more), "
        f"{refused} refused"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default=None, help=f"comma-separated, of: {', '.join(BUILDERS)} (default all)"
    )
    parser.add_argument(
        "--precision",
        default="fp32",
        type=lambda s: s.split(","),
        help="comma-separated, of: fp32, bf16-mixed (default fp32)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"only {', '.join(QUICK_MODELS)} (unless --models)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write every row to this JSON file")
    args = parser.parse_args()
    if args.models:
        names = [n for n in args.models.split(",") if n]
    else:
        names = list(QUICK_MODELS if args.quick else BUILDERS)
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(BUILDERS)}")
    for p in args.precision:
        if p not in PRECISIONS:
            parser.error(f"unknown precision {p!r}; choose from {', '.join(PRECISIONS)}")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    commit = memfit_commit()  # the library as this run imports it
    start = time.perf_counter()
    reports: list[ModelReport] = []
    skipped: dict[str, str] = {}
    for name in names:
        try:
            subject = BUILDERS[name]()
            # One step first, so the optimizer state exists in every copy measured.
            make_step(subject.model, subject.optimizer, subject.batch, subject.loss_fn, "fp32")()
        except Exception as exc:  # transformers cannot build it here: say why, go on
            skipped[name] = error_text(exc)
            print(f"skipping {name}: {skipped[name]}", file=sys.stderr)
            continue
        for precision in args.precision:
            reports.append(model_report(subject, precision))
        del subject
    wall = time.perf_counter() - start
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s); memfit plans at "
        f"each peer's measured peak x {PEER_MARGIN} and keeps {RESERVE:.0%} of a budget free; "
        f"peaks by the allocator (torch.profiler memory events); wall time {wall:.0f} s\n"
    )
    for report in reports:
        print(render(report) + "\n")
    for name, why in skipped.items():
        print(f"Skipped {name}: {why}\n")
    print(summary(reports))
    found = findings(reports)
    print(f"\n{len(found)} finding(s)" + (":" if found else ""))
    for line in found:
        print(f"- {line}")
    if args.json:
        meta = run_meta(args, wall, commit, peer_margin=PEER_MARGIN, reserve=RESERVE)
        rows = [dataclasses.asdict(report) for report in reports]
        with open(args.json, "w") as f:
            json.dump(
                {"meta": meta, "models": rows, "skipped": skipped, "findings": found},
                f,
                indent=1,
                default=str,
            )
        print(f"\nrows: {args.json}")


if __name__ == "__main__":
    main()
