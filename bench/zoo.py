"""memfit's budgets on a zoo of models at every point of its frontier, every peak measured.

For each model of ``bench/zoo_models.py`` (tiny Hugging Face models built from their configs,
no weights downloaded: ResNet, ConvNeXt, ViT, GPT-2, Llama, BERT, T5, Mixtral, Whisper, Swin,
Mamba, Wav2Vec2 with its CTC loss, SegFormer, CLIP, Qwen3 with tied embeddings, BART,
DeBERTa-v2, GPT-NeoX, Gemma2, BEiT; and memfit's GPT, a chain of residual MLP
blocks 16x apart in width, an LSTM language model and an ``nn.EmbeddingBag`` recommender;
and Llama and BERT fine-tuned through PEFT's LoRA adapters, their weights frozen) and
each precision (fp32, and bf16-mixed: ``torch.autocast("cpu", torch.bfloat16)`` around
forward):

* **no plan**: the step without checkpointing, predicted (``memfit.plan`` without a
  budget, which also gives memfit's (peak, recompute) frontier) and measured;
* **every frontier point**: a budget at each point's peak (divided by ``1 - RESERVE``, plus
  a byte: the planner keeps ``RESERVE`` of a budget free), at most ``--points`` of them
  evenly spread over a longer frontier (its first and last included): memfit's
  ``optimal`` plan at each, applied, and the peak of a whole training step (``zero_grad``,
  forward, backward, ``optimizer.step()``) measured by the allocator oracle
  (``memfit.allocator.allocator_peak``: torch.profiler memory events) and by the dispatch
  tracker (``memfit.measure``); whether it stays within the budget, the prediction error,
  the recompute FLOPs planned and counted (``flop_counter``: the step's FLOPs less those of
  the step without a plan);
* **the Hugging Face peer** where the model supports it: ``gradient_checkpointing_enable``
  (non-reentrant) on a copy of the model and its optimizer, its measured peak and counted
  recompute FLOPs; then memfit planned with the peer's measured peak as the budget: is it
  accepted, does it stay within, does it recompute fewer FLOPs;
* **gradients** (fp32): the middle one of the measured plans that recompute something, on
  a copy of the model with every dropout probability 0, against the same copy unplanned,
  one seeded step each: are all parameter gradients (and buffers, e.g. BatchNorm's running
  statistics) bitwise equal (``torch.equal``); and, for models with dropout, the same with
  dropout on.

Every step is seeded (torch and numpy: the same dropout masks, layer drops and Wav2Vec2's
SpecAugment masks in every step, profiled or measured) and runs after a warm-up step under
the same plan; the optimizer state exists before the first measurement (one step is run
first). A crash on a row is recorded with its error and the run goes on.
``memfit.plan(precision="bf16-mixed")`` plans the step as memfit trains it, with memfit's
fp32 islands (normalization layers in fp32), and so do the bf16 steps measured here;
``--plain-autocast`` measures plain ``torch.autocast`` instead.

    python bench/zoo.py --json zoo.json         # the tables in docs/benchmarks.md
    python bench/zoo.py --quick                 # smoke run: one budget per model, fp32
    python bench/zoo.py --models gpt2,t5 --points 5 --precision fp32
    python bench/zoo.py --precision bf16-mixed --plain-autocast   # bf16 without islands
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from bench_meta import memfit_commit, run_meta  # bench/bench_meta.py
from torch import nn
from zoo_models import ZOO, LossFn, ZooModel, hf_loss, make_optimizer  # bench/zoo_models.py

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.planner import RESERVE
from memfit.checkpoint.profiler import flop_counter
from memfit.units import format_bytes

PRECISIONS = ("fp32", "bf16-mixed")
#: The most frontier points measured per model and precision; a longer frontier is thinned.
MAX_POINTS = 12


def seeded(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` with torch's and numpy's random state reset first, so that every step
    (memfit's profiled ones and the measured ones) draws the same dropout masks, skips the
    same layers (layer drop) and masks the same frames (Wav2Vec2's SpecAugment, numpy's)."""

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        return loss_fn(model, batch)

    return loss


def make_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    inputs: Any,
    precision: str,
    loss_fn: LossFn = hf_loss,
) -> Callable[[], None]:
    """One whole training step; bf16-mixed runs forward under CPU autocast."""
    mixed = precision == "bf16-mixed"

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = loss_fn(model, inputs)
        loss.backward()
        opt.step()

    return step


def measure_step(
    model: nn.Module, opt: torch.optim.Optimizer, inputs: Any, step: Callable
) -> tuple[int, int]:
    """(allocator peak, tracker peak) of ``step``, after a warm-up step."""
    step()
    live = [*model.parameters(), *model.buffers(), *optimizer_tensors(opt), inputs]
    alloc = allocator_peak(step, live=live).peak_bytes
    tracked = memfit.measure(step, model=model, optimizer=opt).peak_bytes
    return int(alloc), int(tracked)


def count_flops(step: Callable[[], None]) -> float:
    with flop_counter() as counter:
        step()
    return float(counter.get_total_flops())


def recomputed_units(plan: memfit.Plan) -> list[str]:
    """The units a plan recomputes: recomputed or selective units, and each child of a
    checkpointed segment (``parent.i``)."""
    units = [name or "<model>" for name, d in plan.decisions.items() if d != "keep"]
    for parent, ranges in plan.segments.items():
        for a, b in ranges:
            units += [f"{parent}.{i}" if parent else str(i) for i in range(a, b + 1)]
    return units


def error_text(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)
    last = f" (at {where[-1].filename.split('site-packages/')[-1]}:{where[-1].lineno})"
    return f"{type(exc).__name__}: {exc}{last if where else ''}"


@dataclass(frozen=True)
class FrontierBudget:
    """The budget at one point of memfit's frontier."""

    index: int
    """The point's place on the frontier, 0 for the least peak."""
    points: int
    """How many points the frontier has."""
    budget_bytes: int
    """The point's peak divided by ``1 - RESERVE``, plus a byte."""


def frontier_budgets(frontier: list, max_points: int, quick: bool) -> list[FrontierBudget]:
    """A budget at each point of ``frontier`` (sorted by peak), at most ``max_points`` of
    them evenly spread (the first and last included) when it is longer; ``quick``: the
    middle point alone.

    >>> from memfit.checkpoint.solvers.frontier import FrontierPoint
    >>> pts = [FrontierPoint(98.0 * i, 0.0, 0.0) for i in range(1, 31)]
    >>> [b.index for b in frontier_budgets(pts, 4, False)], frontier_budgets(pts, 4, True)[0]
    ([0, 10, 19, 29], FrontierBudget(index=15, points=30, budget_bytes=1601))
    """
    n = len(frontier)
    if quick:
        indices = [n // 2]
    elif n <= max_points:
        indices = list(range(n))
    else:
        indices = sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})
    return [FrontierBudget(i, n, int(frontier[i].peak_bytes / (1 - RESERVE)) + 1) for i in indices]


@dataclass
class Subject:
    """One model of the zoo under test: the model, its optimizer, one batch, its loss."""

    name: str
    spec: ZooModel
    model: nn.Module
    opt: torch.optim.Optimizer
    inputs: Any
    loss_fn: LossFn


class Bench:
    """The rows of one run, and the measurements they are made of."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        self.rows.append(row)
        status = row.get("error") or ""
        measured = "–" if row.get("measured") is None else format_bytes(int(row["measured"]))
        print(
            f"  {row['model']:<11} {row['precision']:<10} {row['variant']:<20} "
            f"{measured} {status[:120]}",
            file=sys.stderr,
            flush=True,
        )
        return row

    def plan_row(
        self, s: Subject, precision: str, budget: int, variant: str, base_flops: float
    ) -> tuple[dict[str, Any], memfit.Plan | None]:
        """Plan at ``budget``, apply, measure a step, remove the plan."""
        row: dict[str, Any] = {
            "model": s.name,
            "precision": precision,
            "variant": variant,
            "budget": budget,
        }
        plan = None
        try:
            # The step keeps only the loss, as Hugging Face's Trainer does: the model's
            # output is gone before backward; memfit profiles that step.
            plan = memfit.plan(
                s.model, s.inputs, s.loss_fn, budget=budget, precision=precision, optimizer=s.opt
            )
            units = recomputed_units(plan)
            row.update(
                predicted=float(plan.predicted_peak_bytes),
                recompute_flops_planned=float(plan.recompute_flops),
                units_recomputed=len(units),
                selective=sum(d == "selective" for d in plan.decisions.values()),
                recomputed=units,
                exact=plan.exact,
                notes=list(plan.notes),
            )
            memfit.apply_plan(s.model, plan)
            try:
                step = make_step(s.model, s.opt, s.inputs, precision, s.loss_fn)
                row["measured"], row["tracked"] = measure_step(s.model, s.opt, s.inputs, step)
                row["recompute_flops_counted"] = count_flops(step) - base_flops
            finally:
                memfit.remove_plan(s.model)
            row["within_budget"] = row["measured"] <= budget
            row["error_pct"] = 100 * (row["predicted"] - row["measured"]) / row["measured"]
        except Exception as exc:  # a crash on a model is a finding: record it, go on
            row["error"] = error_text(exc)
            plan = None
        return self.add(row), plan

    def model_rows(self, name: str) -> None:
        spec = ZOO[name]
        torch.manual_seed(0)
        model = spec.build()
        inputs = spec.batch(torch.Generator().manual_seed(0))
        opt = make_optimizer(model, self.args.optimizer)
        s = Subject(name, spec, model, opt, inputs, seeded(spec.loss))
        make_step(model, opt, inputs, "fp32", s.loss_fn)()  # the optimizer state exists
        precisions = ["fp32"] if self.args.quick else self.args.precision
        for precision in precisions:
            # The step as memfit's Engine trains it (and as memfit.plan plans it),
            # normalization layers in fp32; --plain-autocast: plain autocast, no islands.
            islands = self.args.islands and precision != "fp32"
            if islands:
                memfit.precision.apply_precision(model, memfit.PrecisionPolicy(precision))
            try:
                self.precision_rows(s, precision)
            finally:
                if islands:
                    memfit.precision.remove_precision(model)

    def precision_rows(self, s: Subject, precision: str) -> None:
        base: dict[str, Any] = {"model": s.name, "precision": precision, "variant": "no plan"}
        try:
            whole = memfit.plan(s.model, s.inputs, s.loss_fn, precision=precision, optimizer=s.opt)
            step = make_step(s.model, s.opt, s.inputs, precision, s.loss_fn)
            base["measured"], base["tracked"] = measure_step(s.model, s.opt, s.inputs, step)
            base_flops = count_flops(step)
            base.update(
                predicted=float(whole.predicted_peak_bytes),
                error_pct=100 * (whole.predicted_peak_bytes - base["measured"]) / base["measured"],
                step_flops=base_flops,
                frontier=[[p.peak_bytes, p.recompute_flops] for p in whole.frontier],
                notes=list(whole.notes),
            )
        except Exception as exc:
            base["error"] = error_text(exc)
            self.add(base)
            return
        budgets = frontier_budgets(whole.frontier, self.args.points, self.args.quick)
        base["points_measured"] = len(budgets)
        self.add(base)
        plans = []
        for b in budgets:
            variant = f"point {b.index + 1}/{b.points}"
            row, plan = self.plan_row(s, precision, b.budget_bytes, variant, base_flops)
            row["point"], row["points"] = b.index + 1, b.points
            plans.append(plan)
        if precision == "fp32":
            recomputing = [p for p in plans if p is not None and recomputed_units(p)]
            self.gradient_row(s, recomputing[len(recomputing) // 2] if recomputing else None)
        if getattr(s.model, "supports_gradient_checkpointing", False):
            self.peer_rows(s, precision, base_flops)

    def peer_rows(self, s: Subject, precision: str, base_flops: float) -> None:
        """Hugging Face's gradient checkpointing on a copy, then memfit at its peak."""
        row: dict[str, Any] = {
            "model": s.name,
            "precision": precision,
            "variant": "HF checkpointing",
        }
        try:
            peer, peer_opt = copy.deepcopy((s.model, s.opt))  # the copy's optimizer holds the copy
            step = make_step(peer, peer_opt, s.inputs, precision, s.loss_fn)
            without = count_flops(step)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # renamed in transformers 5
                peer.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
            row["measured"], row["tracked"] = measure_step(peer, peer_opt, s.inputs, step)
            row["recompute_flops_counted"] = count_flops(step) - without
            del peer, peer_opt
        except Exception as exc:
            row["error"] = error_text(exc)
            self.add(row)
            return
        self.add(row)
        at, _ = self.plan_row(s, precision, row["measured"], "memfit @ HF peak", base_flops)
        at["accepted"] = "error" not in at or not at["error"].startswith("BudgetError")
        least = next(
            (
                r
                for r in self.rows
                if r["model"] == s.name
                and r["precision"] == precision
                and r.get("point") == 1
                and "measured" in r
            ),
            None,
        )
        if least is not None:  # memfit's least plan, measured in its frontier row
            at["least_predicted"] = least["predicted"]
            at["least_measured"] = least["measured"]
            at["least_recompute_flops"] = least["recompute_flops_counted"]
        at["peer_recompute_flops"] = row["recompute_flops_counted"]
        if "recompute_flops_counted" in at:
            at["flops_le_peer"] = at["recompute_flops_counted"] <= row["recompute_flops_counted"]

    def gradient_row(self, s: Subject, plan: memfit.Plan | None) -> None:
        """A measured plan's gradients against the unplanned model's, bitwise."""
        row: dict[str, Any] = {"model": s.name, "precision": "fp32", "variant": "gradients"}
        if plan is None:
            row["error"] = "no measured plan that recomputes anything"
            self.add(row)
            return
        row["budget"] = plan.budget_bytes
        row["units_recomputed"] = len(recomputed_units(plan))
        row["selective"] = sum(d == "selective" for d in plan.decisions.values())
        try:
            torch.manual_seed(0)  # the twin's weights are loaded; any left unset are seeded
            twin = s.spec.build(dropout=False)
            twin.load_state_dict(s.model.state_dict())
            row.update(_compare(twin, plan, s.inputs, s.loss_fn, "dropout0"))
            if s.spec.has_dropout():
                row.update(_compare(s.model, plan, s.inputs, s.loss_fn, "dropout"))
        except Exception as exc:
            row["error"] = error_text(exc)
        self.add(row)


def _compare(
    model: nn.Module, plan: memfit.Plan, inputs: Any, loss_fn: LossFn, tag: str
) -> dict[str, Any]:
    """One seeded forward and backward of an unplanned copy of ``model`` and of a planned
    one: how many parameter gradients and buffers differ (``torch.equal``)."""
    ref, planned = copy.deepcopy(model), copy.deepcopy(model)
    memfit.apply_plan(planned, plan)

    def run(m: nn.Module) -> tuple[torch.Tensor, dict, dict]:
        m.zero_grad(set_to_none=True)
        loss = loss_fn(m, inputs)  # seeded: the same masks in both runs
        loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters()}
        return loss.detach(), grads, dict(m.named_buffers())

    loss_a, grads_a, bufs_a = run(ref)
    loss_b, grads_b, bufs_b = run(planned)
    memfit.remove_plan(planned)

    def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

    bad = [n for n in grads_a if not same(grads_a[n], grads_b[n])]
    bad_bufs = [n for n in bufs_a if not same(bufs_a[n], bufs_b[n])]
    return {
        f"{tag}_params": len(grads_a),
        f"{tag}_grads_differ": bad,
        f"{tag}_buffers_differ": bad_bufs,
        f"{tag}_loss_equal": bool(torch.equal(loss_a, loss_b)),
        f"{tag}_equal": not bad and not bad_bufs and bool(torch.equal(loss_a, loss_b)),
    }


# ---------------------------------------------------------------------- the tables


def _b(n: float | None) -> str:
    return "–" if n is None else format_bytes(int(n))


def _mflop(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e6:,.1f}"


def _yes(v: bool | None) -> str:
    return "–" if v is None else ("yes" if v else "**no**")


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:+.1f}%"


def _short(text: str, limit: int = 140) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _units(r: dict[str, Any]) -> str:
    if "units_recomputed" not in r:
        return "–"
    sel = r.get("selective", 0)
    return f"{r['units_recomputed']}" + (f" ({sel} selective)" if sel else "")


def _at_hf(r: dict[str, Any] | None) -> str:
    """memfit at Hugging Face checkpointing's peak: its recompute against the peer's."""
    if r is None:
        return "–"
    if not r.get("accepted", True):
        return "**refused**"
    if "recompute_flops_counted" not in r:
        return f"**error**: {_short(r.get('error', ''), 60)}"
    return f"{_mflop(r['recompute_flops_counted'])} vs {_mflop(r['peer_recompute_flops'])}" + (
        "" if r["flops_le_peer"] else " (**more**)"
    )


def summary_line(rows: list[dict[str, Any]], model: str, precision: str) -> str:
    """One model at one precision: its least point, the budgets it held, its worst
    prediction, its gradients and its recompute at Hugging Face checkpointing's peak."""
    mine = [r for r in rows if r["model"] == model and r["precision"] == precision]
    base = next((r for r in mine if r["variant"] in ("no plan", "setup")), mine[0])
    if "measured" not in base:
        return f"| {model} | {precision} | **error**: {_short(base.get('error', ''))} |||||||"
    points = [r for r in mine if "point" in r]
    total = points[0]["points"] if points else len(base["frontier"])
    least = next((r for r in points if r["point"] == 1), None)
    if least is None:
        least_cell = "–"
    elif "measured" not in least:
        least_cell = f"**error**: {_short(least.get('error', ''), 60)}"
    else:
        least_cell = f"{_b(least['predicted'])} / {_b(least['measured'])}"
    held = sum(r.get("within_budget") is True for r in points)
    refused = sum(r.get("error", "").startswith("BudgetError") for r in points)
    crashed = sum("error" in r for r in points) - refused
    held_cell = f"{held}/{len(points)}" + (f", {refused} refused" if refused else "")
    held_cell += f", {crashed} crashed" if crashed else ""
    errors = [r["error_pct"] for r in mine if r.get("error_pct") is not None]
    grads = next((r for r in rows if r["model"] == model and r["variant"] == "gradients"), None)
    if precision != "fp32" or grads is None:
        grads_cell = "–"
    elif grads.get("error"):
        grads_cell = "**error**"
    else:
        grads_cell = f"{_yes(grads.get('dropout0_equal'))} / {_yes(grads.get('dropout_equal'))}"
    at_hf = next((r for r in mine if r["variant"] == "memfit @ HF peak"), None)
    return (
        f"| {model} | {precision} | {_b(base['predicted'])} / {_b(base['measured'])} "
        f"| {len(points)} of {total} | {least_cell} | {held_cell} "
        f"| {_pct(max(errors, key=abs) if errors else None)} | {grads_cell} | {_at_hf(at_hf)} |"
    )


def print_tables(rows: list[dict[str, Any]]) -> None:
    """The summary, memfit at Hugging Face's peak, the gradients, then every row."""
    print(
        "| model | precision | no plan: predicted / measured | frontier points measured "
        "| least point: predicted / measured | budgets held | worst prediction error "
        "| gradients bitwise (fp32): dropout 0 / on | memfit @ HF peak: recompute MFLOP vs HF |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    pairs = dict.fromkeys((r["model"], r["precision"]) for r in rows if r["variant"] != "gradients")
    for model, precision in pairs:
        print(summary_line(rows, model, precision))
    peers = [r for r in rows if r["variant"] == "memfit @ HF peak"]
    if peers:
        print("\nmemfit planned with Hugging Face checkpointing's measured peak as the budget:\n")
        print(
            "| model | precision | HF peak | HF recompute MFLOP | memfit accepts | memfit "
            "measured | within | memfit recompute MFLOP (counted) | ≤ HF "
            "| memfit's least plan: predicted / measured / MFLOP |"
        )
        print("|---|---|---:|---:|---|---:|---|---:|---|---|")
        for r in peers:
            if r.get("accepted", True) and r.get("error"):
                accepts = f"**error**: {_short(r['error'], 120)}"
            elif not r.get("accepted", True):
                needs = re.search(r"at least ([\d.]+ [KMG]?i?B)", r.get("error", ""))
                accepts = "**no**, BudgetError" + (f" (asks ≥ {needs.group(1)})" if needs else "")
            else:
                accepts = "yes"
            least = (
                f"{_b(r['least_predicted'])} / {_b(r['least_measured'])} / "
                f"{_mflop(r['least_recompute_flops'])}"
                if "least_measured" in r
                else "–"
            )
            print(
                f"| {r['model']} | {r['precision']} | {_b(r['budget'])} "
                f"| {_mflop(r.get('peer_recompute_flops'))} | {accepts} "
                f"| {_b(r.get('measured'))} | {_yes(r.get('within_budget'))} "
                f"| {_mflop(r.get('recompute_flops_counted'))} | {_yes(r.get('flops_le_peer'))} "
                f"| {least} |"
            )
    grads = [r for r in rows if r["variant"] == "gradients"]
    if grads:
        print("\nGradients of a measured plan against the unplanned model (fp32, bitwise):\n")
        print(
            "| model | budget | units recomputed | dropout 0: equal | dropout on: equal "
            "| differing |"
        )
        print("|---|---:|---:|---|---|---|")
        for r in grads:
            if r.get("error"):
                print(
                    f"| {r['model']} | {_b(r.get('budget'))} | **error**: {_short(r['error'])} |||"
                )
                continue
            differ = [
                f"{tag}: {len(r[f'{tag}_grads_differ'])}/{r[f'{tag}_params']} grads, "
                f"{len(r[f'{tag}_buffers_differ'])} buffers"
                for tag in ("dropout0", "dropout")
                if f"{tag}_equal" in r and not r[f"{tag}_equal"]
            ]
            print(
                f"| {r['model']} | {_b(r['budget'])} | {_units(r)} "
                f"| {_yes(r.get('dropout0_equal'))} | {_yes(r.get('dropout_equal'))} "
                f"| {'; '.join(differ) or '–'} |"
            )
    print("\nEvery row (point i/n: the i-th of the frontier's n points, by increasing peak):\n")
    print(
        "| model | precision | variant | budget | predicted | measured (allocator) "
        "| measured (tracker) | error | within | recompute MFLOP planned | counted "
        "| units recomputed |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        if r["variant"] == "gradients":
            continue
        if r.get("error") and "measured" not in r:
            print(
                f"| {r['model']} | {r['precision']} | {r['variant']} | {_b(r.get('budget'))} "
                f"| {_b(r.get('predicted'))} | **error**: {_short(r['error'])} |||||||"
            )
            continue
        print(
            f"| {r['model']} | {r['precision']} | {r['variant']} | {_b(r.get('budget'))} "
            f"| {_b(r.get('predicted'))} | {_b(r.get('measured'))} | {_b(r.get('tracked'))} "
            f"| {_pct(r.get('error_pct'))} | {_yes(r.get('within_budget'))} "
            f"| {_mflop(r.get('recompute_flops_planned'))} "
            f"| {_mflop(r.get('recompute_flops_counted'))} | {_units(r)} |"
        )


def failures(rows: list[dict[str, Any]], limit_pct: float = 10.0) -> list[str]:
    """Every row that is over budget, mispredicted by more than ``limit_pct``, refused at
    the peer's peak, more costly than the peer, recomputing other than it planned (counted
    FLOPs 1% or more off the planned ones), unequal in gradients, or crashed."""
    out = []
    for r in rows:
        what = f"{r['model']} {r['precision']} {r['variant']}"
        if r.get("error"):
            out.append(f"{what}: {r['error']}")
        if r.get("within_budget") is False:
            over = r["measured"] - r["budget"]
            out.append(
                f"{what}: over budget, measured {_b(r['measured'])} > budget "
                f"{_b(r['budget'])} (+{over:,} B, {100 * over / r['budget']:+.2f}%)"
            )
        if r.get("error_pct") is not None and abs(r["error_pct"]) > limit_pct:
            out.append(
                f"{what}: prediction off by {r['error_pct']:+.1f}% (predicted "
                f"{_b(r['predicted'])}, measured {_b(r['measured'])})"
            )
        planned, counted = r.get("recompute_flops_planned"), r.get("recompute_flops_counted")
        if planned is not None and counted is not None and abs(counted - planned) > 0.01 * planned:
            out.append(
                f"{what}: the plan's recompute did not run as planned: counted "
                f"{_mflop(counted)} MFLOP, planned {_mflop(planned)} (units {r['recomputed']})"
            )
        if r.get("flops_le_peer") is False:
            out.append(
                f"{what}: recomputes more than HF, {_mflop(r['recompute_flops_counted'])} > "
                f"{_mflop(r['peer_recompute_flops'])} MFLOP"
            )
        for tag in ("dropout0", "dropout"):
            if r.get(f"{tag}_equal") is False:
                out.append(
                    f"{what} ({tag}): gradients differ in {r[f'{tag}_grads_differ'][:5]}, "
                    f"buffers in {r[f'{tag}_buffers_differ'][:5]}, loss equal "
                    f"{r[f'{tag}_loss_equal']}"
                )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default=",".join(ZOO), help=f"comma-separated, of: {', '.join(ZOO)}"
    )
    parser.add_argument(
        "--precision",
        default=",".join(PRECISIONS),
        type=lambda s: s.split(","),
        help="comma-separated, of: fp32, bf16-mixed (default both)",
    )
    parser.add_argument(
        "--points",
        type=int,
        default=MAX_POINTS,
        help=f"the most frontier points measured per model and precision (default {MAX_POINTS})",
    )
    parser.add_argument(
        "--optimizer", default="adamw", choices=("adamw", "adamw-foreach", "adamw-fused")
    )
    parser.add_argument(
        "--quick", action="store_true", help="one budget per model (the middle point), fp32"
    )
    parser.add_argument(
        "--plain-autocast",
        dest="islands",
        action="store_false",
        help="bf16-mixed steps under plain torch.autocast, without memfit's fp32 islands "
        "(default: with them, as memfit's Engine trains and memfit.plan plans)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write every row to this JSON file")
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        parser.error(f"unknown models {unknown}; the zoo has {', '.join(ZOO)}")
    for p in args.precision:
        if p not in PRECISIONS:
            parser.error(f"unknown precision {p!r}; choose from {', '.join(PRECISIONS)}")
    if args.points < 2:
        parser.error("--points must be at least 2 (the frontier's least and greatest peaks)")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    bench = Bench(args)
    commit = memfit_commit()  # the library as this run imports it
    start = time.perf_counter()
    for name in names:
        try:
            bench.model_rows(name)
        except Exception as exc:  # building the model or its first step failed
            bench.add(
                {"model": name, "precision": "–", "variant": "setup", "error": error_text(exc)}
            )
    wall = time.perf_counter() - start
    points = "1 (quick: the middle one)" if args.quick else f"at most {args.points}"
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s), "
        f"optimizer {args.optimizer}, frontier points {points} per model and precision, "
        f"bf16-mixed {'with memfit fp32 islands' if args.islands else 'plain autocast'}; "
        f"memfit keeps {RESERVE:.0%} of a budget free; wall time {wall:.0f} s\n"
    )
    print_tables(bench.rows)
    found = failures(bench.rows)
    print(f"\n{len(found)} failure(s)" + (":" if found else ""))
    for line in found:
        print(f"- {line}")
    if args.json:
        configs = {n: ZOO[n].describe() for n in names}
        meta = run_meta(args, wall, commit, reserve=RESERVE, configs=configs)
        with open(args.json, "w") as f:
            json.dump(
                {"meta": meta, "rows": bench.rows, "failures": found}, f, indent=1, default=str
            )
        print(f"\nrows: {args.json}")


if __name__ == "__main__":
    main()
