"""memfit's budgets on a zoo of Hugging Face models built from configs, every peak measured.

For each model (tiny configs of ResNet, ConvNeXt, ViT, GPT-2, Llama, BERT and T5, built
with ``transformers`` from their configs, no weights downloaded) and each precision (fp32,
and bf16-mixed: ``torch.autocast("cpu", torch.bfloat16)`` around forward):

* **no plan**: the step without checkpointing, predicted (``memfit.plan`` without a
  budget) and measured;
* **budgets** across memfit's own frontier, from its least peak (divided by
  ``1 - RESERVE``, plus a byte) to 90% of the way to its greatest: memfit's ``optimal``
  plan at each, applied, and the peak of a whole training step (``zero_grad``, forward,
  backward, ``optimizer.step()``) measured by the allocator oracle
  (``memfit.allocator.allocator_peak``: torch.profiler memory events) and by the dispatch
  tracker (``memfit.measure``); whether it stays within the budget, the prediction error,
  the recompute FLOPs planned and counted (``flop_counter``: the step's FLOPs less those of
  the step without a plan);
* **the Hugging Face peer** where the model supports it: ``gradient_checkpointing_enable``
  (non-reentrant) on a copy of the model and its optimizer, its measured peak and counted
  recompute FLOPs; then memfit planned with the peer's measured peak as the budget: is it
  accepted, does it stay within, does it recompute fewer FLOPs;
* **gradients** (fp32): the mid-budget plan on a copy of the model with every dropout
  probability 0 against the same copy unplanned, one seeded step each: are all parameter
  gradients (and buffers, e.g. BatchNorm's running statistics) bitwise equal
  (``torch.equal``); and, for models with dropout, the same with dropout on.

Every step runs after a warm-up step under the same plan; the optimizer state exists
before the first measurement (one step is run first). A crash on a row is recorded with
its error and the run goes on. ``memfit.plan(precision="bf16-mixed")`` plans the step as memfit
trains it, with memfit's fp32 islands (normalization layers in fp32), and so do the bf16
steps measured here; ``--plain-autocast`` measures plain ``torch.autocast`` instead.

    python bench/zoo.py                         # the table in docs/benchmarks.md
    python bench/zoo.py --quick                 # smoke run: one budget, fp32
    python bench/zoo.py --models gpt2,t5 --budgets 5 --json zoo.json
    python bench/zoo.py --precision bf16-mixed --plain-autocast   # bf16 without islands
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import re
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.planner import RESERVE
from memfit.checkpoint.profiler import flop_counter
from memfit.units import format_bytes

PRECISIONS = ("fp32", "bf16-mixed")
#: Where the budgets lie between the least and the greatest frontier peak, the last one.
TOP_SHARE = 0.9


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: its config, its class and an example batch."""

    config: Callable[[], transformers.PretrainedConfig]
    cls: type[nn.Module]
    batch: Callable[[torch.Generator], dict[str, Any]]
    """The inputs of one step, labels included (the model computes its loss)."""


def _images(n: int, size: int, labels: int) -> Callable[[torch.Generator], dict[str, Any]]:
    def batch(g: torch.Generator) -> dict[str, Any]:
        return {
            "pixel_values": torch.randn(n, 3, size, size, generator=g),
            "labels": torch.randint(0, labels, (n,), generator=g),
        }

    return batch


def _causal(n: int, seq: int, vocab: int) -> Callable[[torch.Generator], dict[str, Any]]:
    def batch(g: torch.Generator) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (n, seq), generator=g)
        # use_cache=False as Hugging Face's own checkpointing trains: memfit does not
        # recompute layers that update a key/value cache.
        return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}

    return batch


def _masked(n: int, seq: int, vocab: int) -> Callable[[torch.Generator], dict[str, Any]]:
    def batch(g: torch.Generator) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (n, seq), generator=g)
        labels = torch.where(torch.rand(n, seq, generator=g) < 0.15, ids, -100)
        return {"input_ids": ids, "labels": labels}

    return batch


def _seq2seq(n: int, src: int, tgt: int, vocab: int) -> Callable[[torch.Generator], dict]:
    def batch(g: torch.Generator) -> dict[str, Any]:
        return {
            "input_ids": torch.randint(0, vocab, (n, src), generator=g),
            "labels": torch.randint(0, vocab, (n, tgt), generator=g),
            "use_cache": False,
        }

    return batch


VOCAB = 1024

ZOO: dict[str, ZooModel] = {
    "resnet": ZooModel(
        lambda: transformers.ResNetConfig(
            embedding_size=16,
            hidden_sizes=[16, 32, 64, 128],
            depths=[2, 2, 2, 2],
            layer_type="basic",
            num_labels=10,
        ),
        transformers.ResNetForImageClassification,
        _images(8, 128, 10),
    ),
    "convnext": ZooModel(
        lambda: transformers.ConvNextConfig(
            hidden_sizes=[16, 32, 64, 128],
            depths=[2, 2, 2, 2],
            image_size=64,
            num_labels=10,
        ),
        transformers.ConvNextForImageClassification,
        _images(8, 64, 10),
    ),
    "vit": ZooModel(
        lambda: transformers.ViTConfig(
            image_size=64,
            patch_size=8,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=256,
            num_labels=10,
        ),
        transformers.ViTForImageClassification,
        _images(8, 64, 10),
    ),
    "gpt2": ZooModel(
        lambda: transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=128,
            n_embd=64,
            n_layer=4,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
        ),
        transformers.GPT2LMHeadModel,
        _causal(8, 128, VOCAB),
    ),
    "llama": ZooModel(
        lambda: transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            bos_token_id=0,
            eos_token_id=0,
        ),
        transformers.LlamaForCausalLM,
        _causal(8, 128, VOCAB),
    ),
    "bert": ZooModel(
        lambda: transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=128,
        ),
        transformers.BertForMaskedLM,
        _masked(8, 128, VOCAB),
    ),
    "t5": ZooModel(
        lambda: transformers.T5Config(
            vocab_size=VOCAB,
            d_model=64,
            d_kv=16,
            d_ff=256,
            num_layers=3,
            num_decoder_layers=3,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
        transformers.T5ForConditionalGeneration,
        _seq2seq(8, 64, 32, VOCAB),
    ),
}


def _dropout_keys(config: transformers.PretrainedConfig) -> list[str]:
    """The config's dropout probabilities (``*dropout*``, ``*pdrop*``, ``drop_path_rate``)."""
    return [
        key for key, value in config.to_dict().items() if isinstance(value, float) and "drop" in key
    ]


def without_dropout(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """A copy of ``config`` with every dropout probability 0 (a deterministic step)."""
    config = copy.deepcopy(config)
    for key in _dropout_keys(config):
        setattr(config, key, 0.0)
    return config


def has_dropout(config: transformers.PretrainedConfig) -> bool:
    return any(getattr(config, key) > 0 for key in _dropout_keys(config))


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    flags = {"adamw": {"foreach": False}, "adamw-foreach": {"foreach": True}}
    flags["adamw-fused"] = {"fused": True}
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **flags[kind])


def make_step(
    model: nn.Module, opt: torch.optim.Optimizer, inputs: dict[str, Any], precision: str
) -> Callable[[], None]:
    """One whole training step; bf16-mixed runs forward under CPU autocast."""
    mixed = precision == "bf16-mixed"

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()

    return step


def measure_step(
    model: nn.Module, opt: torch.optim.Optimizer, inputs: dict[str, Any], step: Callable
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


def budgets_on(frontier: list, n: int, quick: bool) -> list[tuple[float, int]]:
    """``n`` budgets from the least frontier peak the planner can meet to ``TOP_SHARE`` of
    the way to the greatest, each with its share of the way; ``quick``: the middle one."""
    peaks = [p.peak_bytes for p in frontier]
    lo = int(min(peaks) / (1 - RESERVE)) + 1
    hi = max(peaks) / (1 - RESERVE)
    shares = [0.5] if quick else [TOP_SHARE * i / max(1, n - 1) for i in range(n)]
    return [(s, int(lo + s * (hi - lo))) for s in shares]


class Bench:
    """The rows of one run, and the measurements they are made of."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        self.rows.append(row)
        status = row.get("error") or ""
        print(
            f"  {row['model']:<9} {row['precision']:<10} {row['variant']:<24} "
            f"{_b(row.get('measured'))} {status[:120]}",
            file=sys.stderr,
            flush=True,
        )
        return row

    def plan_row(
        self,
        name: str,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        inputs: dict[str, Any],
        precision: str,
        budget: int,
        variant: str,
        base_flops: float,
    ) -> tuple[dict[str, Any], memfit.Plan | None]:
        """Plan at ``budget``, apply, measure a step, remove the plan."""
        row: dict[str, Any] = {
            "model": name,
            "precision": precision,
            "variant": variant,
            "budget": budget,
        }
        plan = None
        try:
            # The step below keeps only the loss (loss = model(**inputs).loss, the first
            # tensor of the output, which the default loss sums), as
            # Hugging Face's Trainer does: the model's output is gone before backward.
            plan = memfit.plan(
                model,
                inputs,
                budget=budget,
                precision=precision,
                optimizer=opt,
                keep_output=False,
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
            memfit.apply_plan(model, plan)
            try:
                step = make_step(model, opt, inputs, precision)
                row["measured"], row["tracked"] = measure_step(model, opt, inputs, step)
                row["recompute_flops_counted"] = count_flops(step) - base_flops
            finally:
                memfit.remove_plan(model)
            row["within_budget"] = row["measured"] <= budget
            row["error_pct"] = 100 * (row["predicted"] - row["measured"]) / row["measured"]
        except Exception as exc:  # a crash on a model is a finding: record it, go on
            row["error"] = error_text(exc)
            plan = None
        return self.add(row), plan

    def model_rows(self, name: str) -> None:
        spec = ZOO[name]
        torch.manual_seed(0)
        config = spec.config()
        model = spec.cls(config)
        model.train()
        inputs = spec.batch(torch.Generator().manual_seed(0))
        opt = make_optimizer(model, self.args.optimizer)
        make_step(model, opt, inputs, "fp32")()  # the optimizer state exists from here on
        precisions = ["fp32"] if self.args.quick else self.args.precision
        for precision in precisions:
            # The step as memfit's Engine trains it (and as memfit.plan plans it),
            # normalization layers in fp32; --plain-autocast: plain autocast, no islands.
            islands = self.args.islands and precision != "fp32"
            if islands:
                memfit.precision.apply_precision(model, memfit.PrecisionPolicy(precision))
            try:
                self.precision_rows(name, spec, config, model, opt, inputs, precision)
            finally:
                if islands:
                    memfit.precision.remove_precision(model)

    def precision_rows(
        self,
        name: str,
        spec: ZooModel,
        config: transformers.PretrainedConfig,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        inputs: dict[str, Any],
        precision: str,
    ) -> None:
        base: dict[str, Any] = {"model": name, "precision": precision, "variant": "no plan"}
        try:
            whole = memfit.plan(
                model,
                inputs,
                precision=precision,
                optimizer=opt,
                keep_output=False,
            )
            step = make_step(model, opt, inputs, precision)
            base["measured"], base["tracked"] = measure_step(model, opt, inputs, step)
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
        self.add(base)
        budgets = budgets_on(whole.frontier, self.args.budgets, self.args.quick)
        plans = []
        for i, (share, budget) in enumerate(budgets):
            row, plan = self.plan_row(
                name, model, opt, inputs, precision, budget, f"budget {i + 1}", base_flops
            )
            row["share"] = share  # 0: the frontier's least peak (plus the reserve)
            plans.append(plan)
        if precision == "fp32":
            self.gradient_row(name, spec, config, model, inputs, plans[len(plans) // 2])
        if getattr(model, "supports_gradient_checkpointing", False):
            self.peer_rows(name, model, opt, inputs, precision, base_flops)

    def peer_rows(
        self,
        name: str,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        inputs: dict[str, Any],
        precision: str,
        base_flops: float,
    ) -> None:
        """Hugging Face's gradient checkpointing on a copy, then memfit at its peak."""
        row: dict[str, Any] = {"model": name, "precision": precision, "variant": "HF checkpointing"}
        try:
            peer, peer_opt = copy.deepcopy((model, opt))  # the copy's optimizer holds the copy
            step = make_step(peer, peer_opt, inputs, precision)
            without = count_flops(step)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # renamed in transformers 5
                peer.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
            row["measured"], row["tracked"] = measure_step(peer, peer_opt, inputs, step)
            row["recompute_flops_counted"] = count_flops(step) - without
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                peer.gradient_checkpointing_disable()
            del peer, peer_opt
        except Exception as exc:
            row["error"] = error_text(exc)
            self.add(row)
            return
        self.add(row)
        at, _ = self.plan_row(
            name, model, opt, inputs, precision, row["measured"], "memfit @ HF peak", base_flops
        )
        at["accepted"] = "error" not in at or not at["error"].startswith("BudgetError")
        least = next(
            (
                r
                for r in self.rows
                if r["model"] == name
                and r["precision"] == precision
                and r.get("share") == 0.0
                and "measured" in r
            ),
            None,
        )
        if least is not None:  # memfit's least plan, measured in its budget row
            at["least_predicted"] = least["predicted"]
            at["least_measured"] = least["measured"]
            at["least_recompute_flops"] = least["recompute_flops_counted"]
        at["peer_recompute_flops"] = row["recompute_flops_counted"]
        if "recompute_flops_counted" in at:
            at["flops_le_peer"] = at["recompute_flops_counted"] <= row["recompute_flops_counted"]

    def gradient_row(
        self,
        name: str,
        spec: ZooModel,
        config: transformers.PretrainedConfig,
        model: nn.Module,
        inputs: dict[str, Any],
        plan: memfit.Plan | None,
    ) -> None:
        """The mid-budget plan's gradients against the unplanned model's, bitwise."""
        row: dict[str, Any] = {"model": name, "precision": "fp32", "variant": "gradients"}
        if plan is None:
            row["error"] = "no mid-budget plan (its row failed)"
            self.add(row)
            return
        row["budget"] = plan.budget_bytes
        row["units_recomputed"] = len(recomputed_units(plan))
        row["selective"] = sum(d == "selective" for d in plan.decisions.values())
        try:
            twin = spec.cls(without_dropout(config))
            twin.load_state_dict(model.state_dict())
            twin.train()
            row.update(_compare(twin, plan, inputs, "dropout0"))
            if has_dropout(config):
                row.update(_compare(model, plan, inputs, "dropout"))
        except Exception as exc:
            row["error"] = error_text(exc)
        self.add(row)


def _compare(model: nn.Module, plan: memfit.Plan, inputs: dict[str, Any], tag: str) -> dict:
    """One seeded forward and backward of an unplanned copy of ``model`` and of a planned
    one: how many parameter gradients and buffers differ (``torch.equal``)."""
    ref, planned = copy.deepcopy(model), copy.deepcopy(model)
    memfit.apply_plan(planned, plan)

    def run(m: nn.Module) -> tuple[torch.Tensor, dict, dict]:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = m(**inputs).loss
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


def _units(r: dict[str, Any]) -> str:
    if "units_recomputed" not in r:
        return "–"
    sel = r.get("selective", 0)
    return f"{r['units_recomputed']}" + (f" ({sel} selective)" if sel else "")


def print_tables(rows: list[dict[str, Any]]) -> None:
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
                f"| {_b(r.get('predicted'))} | **error**: {r['error'][:140]} |"
            )
            continue
        within = r.get("within_budget")
        print(
            f"| {r['model']} | {r['precision']} | {r['variant']} | {_b(r.get('budget'))} "
            f"| {_b(r.get('predicted'))} | {_b(r.get('measured'))} | {_b(r.get('tracked'))} "
            f"| {_pct(r.get('error_pct'))} | {_yes(within)} "
            f"| {_mflop(r.get('recompute_flops_planned'))} "
            f"| {_mflop(r.get('recompute_flops_counted'))} | {_units(r)} |"
        )
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
                accepts = f"**error**: {r['error'][:120]}"
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
        print("\nGradients of the mid-budget plan against the unplanned model (fp32, bitwise):\n")
        print(
            "| model | budget | units recomputed | dropout 0: equal | dropout on: equal "
            "| differing |"
        )
        print("|---|---:|---:|---|---|---|")
        for r in grads:
            if r.get("error"):
                print(f"| {r['model']} | {_b(r.get('budget'))} | **error**: {r['error'][:200]} |")
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


def _commit() -> str | None:
    """The repository's commit, "+dirty" when memfit/ differs from it (read only)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "memfit"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


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
    parser.add_argument("--budgets", type=int, default=3, help="budgets per model and precision")
    parser.add_argument(
        "--optimizer", default="adamw", choices=("adamw", "adamw-foreach", "adamw-fused")
    )
    parser.add_argument("--quick", action="store_true", help="one budget per model, fp32 only")
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
    if args.budgets < 1:
        parser.error("--budgets must be at least 1")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    bench = Bench(args)
    commit = _commit()  # the library as this run imports it
    start = time.perf_counter()
    for name in names:
        try:
            bench.model_rows(name)
        except Exception as exc:  # building the model or its first step failed
            bench.add(
                {"model": name, "precision": "–", "variant": "setup", "error": error_text(exc)}
            )
    wall = time.perf_counter() - start
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s), "
        f"optimizer {args.optimizer}, budgets {'1 (quick)' if args.quick else args.budgets}, "
        f"bf16-mixed {'with memfit fp32 islands' if args.islands else 'plain autocast'}; "
        f"memfit keeps {RESERVE:.0%} of a budget free; wall time {wall:.0f} s\n"
    )
    print_tables(bench.rows)
    found = failures(bench.rows)
    print(f"\n{len(found)} failure(s)" + (":" if found else ""))
    for line in found:
        print(f"- {line}")
    if args.json:
        meta = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "memfit_commit": commit,
            "args": vars(args),
            "wall_seconds": wall,
            "configs": {n: ZOO[n].config().to_dict() for n in names},
        }
        with open(args.json, "w") as f:
            json.dump(
                {"meta": meta, "rows": bench.rows, "failures": found}, f, indent=1, default=str
            )
        print(f"\nrows: {args.json}")


if __name__ == "__main__":
    main()
