"""``memfit.tune`` refereed against the usual fixes, over several models and budgets.

For each model (the built-in GPT, ResNet and LSTM, and a Hugging Face BERT masked LM built
from the zoo's config), the budget is a fraction of the plain step's peak (fp32, no
checkpointing, the whole global batch as one micro-batch, AdamW; the allocator's peak of a
step after a warm-up). For each budget the bench runs ``memfit.tune`` (which measures its
own trials and peers), then builds its own settings, independently of the tuner's trials,
in each precision of ``--precisions``:

(a) ``halving``: the micro-batch halved and the accumulation doubled until the measured
    peak fits (no checkpointing; the global batch kept);
(b) ``per-block``: every block checkpointed (``checkpoint="full"``), the whole batch as one
    micro-batch (whether it fits is recorded);

and the tuned choice (``res.engine_kwargs()``; where it is a peer's very setting, that
peer's engine stands for it, so the ratio to that peer is 1), and the Engine's own
``micro_batch="auto"`` at the budget (``precision="auto"`` where several precisions are
compared), its choice made on its first batch by its own timed trials. Each is timed in
``--rounds`` interleaved rounds, the order rotated each round (a slow moment of a shared
machine hits all alike); the median is reported, with the tuned median over each peer's
and over the fastest peer that fits (the goal: at most 1.03). A budget the
tuner refuses (``BudgetError``) is printed with its message and skipped. Also printed: the
tuning time, the tuner's timed rounds, its verdict, and its Spearman rank correlation of
predicted and measured step times.

Run (CPU: bf16 is emulated, hence slow, so the models are tiny)::

    python bench/tune.py [--models gpt,resnet,lstm,bert] [--budgets 0.3,0.5,0.7]
                         [--precisions fp32,bf16-mixed] [--rounds 7] [--json out.json]

On a small machine shared with other work, pin it to cores that are free (``taskset -c 1
python bench/tune.py``; torch then starts as many threads as it is given cores): intra-op
threads that outnumber the free cores wait on one another, and steps take 10-80x longer.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from zoo_models import VOCAB, ZOO, _masked, hf_loss  # bench/zoo_models.py

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.errors import BudgetError
from memfit.models import build_model
from memfit.units import format_bytes

from gpt_setup import add_gpt_arguments, build_gpt

LossFn = Callable[[nn.Module, Any], torch.Tensor]
#: The ratio of the tuned median to the fastest fitting peer's that counts as a success.
GOAL = 1.03


@dataclass(frozen=True)
class Workload:
    """A model to tune: ``model_fn()`` builds it (the caller seeds), ``batch_fn(n)`` gives
    the same ``n`` samples every call."""

    name: str
    about: str
    model_fn: Callable[[], nn.Module]
    batch_fn: Callable[[int], Any]
    loss_fn: LossFn


def workloads(args: argparse.Namespace) -> dict[str, Callable[[], Workload]]:
    """The models by name, each built only when selected."""

    def gpt() -> Workload:
        _, loss_fn, batch_fn = build_gpt(args)
        about = f"GPT {args.n_layer}x{args.n_embd}, block {args.block_size}"
        return Workload(
            "gpt", about, lambda: build_gpt(args)[0], lambda n: batch_fn(n, generator=0), loss_fn
        )

    def builtin(name: str, about: str, **sizes: Any) -> Workload:
        _, loss_fn, batch_fn = build_model(name, data="synthetic", **sizes)
        return Workload(
            name,
            about,
            lambda: build_model(name, data="synthetic", **sizes).model,
            lambda n: batch_fn(n, generator=0),
            loss_fn,
        )

    def bert() -> Workload:
        spec, seq = ZOO["bert"], 64
        cfg = spec.config()  # type: ignore[misc]
        about = f"HF BertForMaskedLM {cfg.num_hidden_layers}x{cfg.hidden_size}, seq {seq}"
        return Workload(
            "bert",
            about,
            spec.build,
            lambda n: _masked(n, seq, VOCAB)(torch.Generator().manual_seed(0)),
            hf_loss,
        )

    return {
        "gpt": gpt,
        "resnet": lambda: builtin(
            "resnet",
            "ResNet (8,16,32)x1, 32x32 images",
            widths=(8, 16, 32),
            blocks_per_stage=(1, 1, 1),
            image_size=32,
        ),
        "lstm": lambda: builtin(
            "lstm", "LSTM 2x128, seq 64", n_embd=64, hidden_size=128, n_layer=2, seq_len=64
        ),
        "bert": bert,
    }


@dataclass
class Built:
    """One setting trained by the bench: its engine, the global batch, the measured peak."""

    engine: memfit.Engine
    batch: Any
    peak: int


@dataclass
class Entry:
    """One setting of one (model, budget) case, with its timed steps."""

    name: str
    kind: str  # "tuned", "halving" or "per-block"
    setting: tuple[Any, ...]  # Bench.key of its Engine arguments
    built: Built
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def fastest(self) -> float:
        return min(self.times)


class Bench:
    """Builds and caches one workload's settings: a setting that does not depend on the
    budget is built once and timed again in every case."""

    def __init__(self, w: Workload, global_batch: int) -> None:
        self.w, self.global_batch = w, global_batch
        self.cache: dict[tuple[Any, ...], Built] = {}

    @staticmethod
    def key(kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The setting, defaults filled in: the same setting spelled two ways is one."""
        full = {"checkpoint": "none", "accumulation_steps": 1, **kwargs}
        return tuple(sorted((k, v) for k, v in full.items() if v is not None))

    def build(self, kwargs: dict[str, Any], cached: bool = True) -> Built:
        """The setting's engine after a measured step; ``cached=False``: a fresh one."""
        key = self.key(kwargs)
        if key in self.cache and cached:
            return self.cache[key]
        torch.manual_seed(0)
        model = self.w.model_fn()
        optimizer = torch.optim.AdamW(model.parameters())
        engine = memfit.Engine(model, optimizer, monitor=False, log_every=10**9, **kwargs)
        batch = self.w.batch_fn(self.global_batch)
        built = Built(engine, batch, self.measured_peak(engine, batch))
        if cached:
            self.cache[key] = built
        return built

    def measured_peak(self, engine: memfit.Engine, batch: Any) -> int:
        engine.train_step(batch, self.w.loss_fn)  # warm-up: planning, the optimizer's state
        live = [
            *engine.model.parameters(),
            *engine.model.buffers(),
            *optimizer_tensors(engine.optimizer),
            batch,
        ]
        step = lambda: engine.train_step(batch, self.w.loss_fn)  # noqa: E731
        return allocator_peak(step, live).peak_bytes

    def halving(self, precision: str, budget: int) -> Entry:
        """Peer (a): the micro-batch halved until the measured peak fits (or is 1)."""
        micro = self.global_batch
        while True:
            kwargs = {"precision": precision, "accumulation_steps": self.global_batch // micro}
            built = self.build(kwargs)
            smaller = [d for d in range(1, micro // 2 + 1) if self.global_batch % d == 0]
            if built.peak <= budget or not smaller:
                name = f"halving {precision} {micro}x{self.global_batch // micro}"
                return Entry(name, "halving", self.key(kwargs), built)
            micro = max(smaller)

    def per_block(self, precision: str) -> Entry:
        """Peer (b): every block checkpointed, the whole batch as one micro-batch."""
        kwargs = {"precision": precision, "checkpoint": "full"}
        name = f"per-block {precision} {self.global_batch}x1"
        return Entry(name, "per-block", self.key(kwargs), self.build(kwargs))


def time_rounds(entries: list[Entry], rounds: int, loss_fn: LossFn) -> None:
    """One step of every entry per round, the order rotated by one each round."""
    for r in range(rounds):
        for e in entries[r % len(entries) :] + entries[: r % len(entries)]:
            start = time.perf_counter()
            e.built.engine.train_step(e.built.batch, loss_fn)
            e.times.append(time.perf_counter() - start)


def choice_name(res: Any) -> str:
    b = res.best
    return f"{b.precision} {b.checkpoint} {b.micro_batch}x{b.accumulation_steps}"


def run_case(
    bench: Bench, fraction: float, plain_peak: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Tune one budget, then time the tuned choice beside the peers; the case's JSON row."""
    w, budget = bench.w, int(fraction * plain_peak)
    row: dict[str, Any] = {"model": w.name, "fraction": fraction, "budget_bytes": budget}
    print(f"\n### {w.name} at {fraction:g} of the plain peak: {format_bytes(budget)}")
    started = time.perf_counter()
    try:
        res = memfit.tune(
            w.model_fn,
            w.batch_fn,
            w.loss_fn,
            budget=budget,
            global_batch=bench.global_batch,
            precisions=args.precisions,
        )
    except BudgetError as exc:
        print(f"the tuner refused the budget: {exc}")
        return {**row, "refused": str(exc), "tuning_seconds": time.perf_counter() - started}
    wall = time.perf_counter() - started
    print(res.summary(max_rows=12))
    spearman = res.rank_correlation
    print(
        f"tuning: {res.tuning_seconds:.1f} s (wall {wall:.1f} s), {res.rounds} rounds; "
        f"verdict: {res.verdict}; Spearman " + ("-" if spearman is None else f"{spearman:.2f}")
    )

    peers: list[Entry] = []
    for precision in args.precisions:
        peers += [bench.halving(precision, budget), bench.per_block(precision)]
    # Where the tuned choice is a peer's very setting, that peer's engine stands for it
    # (two engines of one setting differ only by this machine's noise); otherwise it gets
    # an engine of its own.
    setting = bench.key(res.engine_kwargs())
    tuned = next((e for e in peers if e.setting == setting), None)
    entries = list(peers)
    if tuned is None:
        built = bench.build(res.engine_kwargs(), cached=False)
        tuned = Entry(f"tuned {choice_name(res)}", "tuned", setting, built)
        entries.insert(0, tuned)
    engine = engine_auto(bench, budget, args) if args.engine else None
    if engine is not None:
        entries.append(engine)
    time_rounds(entries, args.rounds, w.loss_fn)

    fitting = [e for e in peers if e.built.peak <= budget]
    fastest = min(fitting, key=lambda e: e.median) if fitting else None
    print(
        "\n| setting | peak (allocator) | fits | step, median | step, fastest "
        "| tuned / this, median | tuned / this, fastest |"
    )
    print("|---|---|---|---|---|---|---|")
    for e in entries:
        fits = "yes" if e.built.peak <= budget else "**no**"
        mark = " (the tuned choice)" if e is tuned and e.kind != "tuned" else ""
        print(
            f"| {e.name}{mark} | {format_bytes(e.built.peak)} | {fits} | {e.median * 1e3:,.1f} ms "
            f"| {e.fastest * 1e3:,.1f} ms | {tuned.median / e.median:.3f} "
            f"| {tuned.fastest / e.fastest:.3f} |"
        )
    ratio = tuned.median / fastest.median if fastest else None
    engine_ratio = engine.median / fastest.median if engine and fastest else None
    if engine is not None and engine_ratio is not None:
        mark = "goal met" if engine_ratio <= GOAL else f"**over the goal {GOAL}**"
        print(f"Engine micro_batch='auto' / fastest fitting peer: {engine_ratio:.3f} ({mark})")
        print(
            engine.built.engine.auto.split_timed.describe()
            if engine.built.engine.auto.split_timed
            else "Engine: chosen by prediction"
        )
    same = fastest is tuned
    if fastest is not None and ratio is not None:
        mark = "goal met" if ratio <= GOAL else f"**over the goal {GOAL}**"
        note = "; the tuner chose that peer's setting" if same else ""
        print(f"tuned / fastest fitting peer ({fastest.name}): {ratio:.3f} ({mark}{note})")
    return {
        **row,
        "tuned": choice_name(res),
        "tuned_kwargs": res.engine_kwargs(),
        "tuned_peak_bytes": tuned.built.peak,
        "tuned_median_seconds": tuned.median,
        "tuned_fastest_seconds": tuned.fastest,
        "tuner_measured_seconds": res.best.measured_step_seconds,
        "peers": {
            e.name: {
                "kind": e.kind,
                "peak_bytes": e.built.peak,
                "median_seconds": e.median,
                "fastest_seconds": e.fastest,
            }
            for e in peers
        },
        "fastest_peer": fastest.name if fastest else None,
        "fastest_peer_median_seconds": fastest.median if fastest else None,
        "ratio": ratio,
        "engine_auto": engine.name if engine else None,
        "engine_auto_peak_bytes": engine.built.peak if engine else None,
        "engine_auto_median_seconds": engine.median if engine else None,
        "engine_auto_ratio": engine_ratio,
        "engine_auto_choice_seconds": (
            engine.built.engine.auto.split_timed.seconds
            if engine and engine.built.engine.auto.split_timed
            else None
        ),
        "same_setting": same,
        "tuning_seconds": res.tuning_seconds,
        "tuner_rounds": res.rounds,
        "verdict": res.verdict,
        "spearman": spearman,
        "step_time": res.to_dict()["step_time"],
        "tuner_rows": [r.to_dict() for r in res.rows if r.measured],
    }


def engine_auto(bench: Bench, budget: int, args: argparse.Namespace) -> Entry | None:
    """The Engine's own ``micro_batch="auto"`` (and ``precision="auto"`` where more than one
    precision is compared) at the budget: its choice made on its first batch, timed beside
    the peers; None (printed) when it refuses the budget."""
    precision = "auto" if len(args.precisions) > 1 else args.precisions[0]
    kwargs = {"precision": precision, "micro_batch": "auto", "memory_budget": budget}
    try:
        built = bench.build(kwargs, cached=False)
    except BudgetError as exc:
        print(f"the Engine's micro_batch='auto' refused the budget: {exc}")
        return None
    e = built.engine
    what = (
        "none" if e.plan is None else f"{e.plan.strategy} {e.plan.recompute_flops / 1e6:.0f} MFLOP"
    )
    name = (
        f"engine-auto {e.settings.precision} {bench.global_batch // e.settings.accumulation_steps}"
        f"x{e.settings.accumulation_steps} ({what})"
    )
    return Entry(name, "engine", bench.key(kwargs), built)


def summary_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | budget | tuned choice | tuned median | fastest fitting peer | ratio "
        "| tuning s | Spearman | Engine auto | Engine ratio | Engine choice s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = f"{r['fraction']:g} ({format_bytes(r['budget_bytes'])})"
        if "refused" in r:
            lines.append(f"| {r['model']} | {budget} | refused | - | - | - | - | - | - | - | - |")
            continue
        peer = (
            f"{r['fastest_peer']}, {r['fastest_peer_median_seconds'] * 1e3:,.1f} ms"
            if r["fastest_peer"]
            else "none fits"
        )
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        ratio += " (its setting)" if r["same_setting"] else ""
        rho = "-" if r["spearman"] is None else f"{r['spearman']:.2f}"
        eng = r.get("engine_auto") or "-"
        eng_ratio = "-" if r.get("engine_auto_ratio") is None else f"{r['engine_auto_ratio']:.3f}"
        eng_s = r.get("engine_auto_choice_seconds")
        lines.append(
            f"| {r['model']} | {budget} | {r['tuned']} | {r['tuned_median_seconds'] * 1e3:,.1f} ms"
            f" | {peer} | {ratio} | {r['tuning_seconds']:.1f} | {rho} | {eng} | {eng_ratio}"
            f" | {'-' if eng_s is None else f'{eng_s:.1f}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="gpt,resnet,lstm,bert")
    parser.add_argument("--budgets", default="0.3,0.5,0.7", help="fractions of the plain peak")
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--json", default=None, help="write the rows to this path")
    parser.add_argument(
        "--no-engine",
        dest="engine",
        action="store_false",
        help="leave out the Engine's own micro_batch='auto' choice",
    )
    add_gpt_arguments(parser, n_layer=4, n_embd=128, n_head=4, block_size=64, batch_size=16)
    args = parser.parse_args()
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    fractions = [float(f) for f in args.budgets.split(",") if f.strip()]
    makers = workloads(args)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in makers]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(makers)}")

    began = time.perf_counter()
    print(
        f"global batch {args.batch_size}; precisions {', '.join(args.precisions)}; "
        f"{args.rounds} rounds; torch threads {torch.get_num_threads()}"
    )
    rows: list[dict[str, Any]] = []
    for name in names:
        w = makers[name]()
        bench = Bench(w, args.batch_size)
        plain_peak = bench.build({"precision": "fp32"}).peak
        print(f"\n## {w.about}: plain fp32 peak {format_bytes(plain_peak)}")
        for fraction in fractions:
            row = run_case(bench, fraction, plain_peak, args)
            rows.append({**row, "about": w.about, "plain_peak_bytes": plain_peak})
        del bench
        gc.collect()

    print(f"\n## Summary ({time.perf_counter() - began:.0f} s in all)\n")
    print(summary_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2, default=str)


if __name__ == "__main__":
    main()
