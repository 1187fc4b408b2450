"""memfit's callbacks beside the frameworks' own checkpointing: peak, step time, planning.

Two tables, each measured side by side in one run (the same model, data and settings
per row; only the checkpointing differs):

* **Hugging Face Trainer**, a tiny GPT-2 built from a config: no callback; HF's own
  activation checkpointing (``TrainingArguments(gradient_checkpointing=True)``, named
  ``activation_checkpointing`` in transformers 5.x) non-reentrant and reentrant, and
  ``every_n_layers`` where the installed transformers has it; ``MemfitCallback`` with
  strategy "full", and "optimal" at three budgets: HF checkpointing's measured peak, and
  30% and 70% of the way from memfit's least measured peak to the unplanned one.
* **Lightning**, docs/integrations.md's ``Stack`` (Linear-GELU-Linear blocks and a
  head), under ``precision="bf16-mixed"`` and ``"32-true"``: no callback, memfit "full",
  and "optimal" at three budgets (the docs' 19MiB, 30% and 70%; 32-true: 30%, 50%, 70%).
  Lightning has no activation checkpointing of its own for a module on one device (only
  its FSDP and DeepSpeed strategies have one).

What each row reports:

* **peak**: step 2 (the first that starts with the optimizer state) measured with
  memfit's allocator oracle (``memfit.allocator.allocator_peak``: on CPU, torch.profiler's
  memory events), from the tensors alive when each window starts (parameters, buffers,
  gradients, optimizer state, the batch). Trainer: two windows, ``training_step``
  (forward and backward) and the optimizer's ``step``; the peak is the larger. Lightning:
  one window, the optimizer's ``step(closure)``, inside which Lightning runs
  ``training_step``, ``zero_grad`` and backward, i.e. the whole step. Step 1 runs under
  the oracle too (see :data:`MEASURED_STEP`).
* **predicted**: the plan's predicted peak of a whole step (memfit rows); **held**:
  whether the measured peak is within the budget.
* **step ms**, **cpu ms**: the median wall and CPU time of steps 3 .. 2 + ``--steps``
  (the profiler slows steps 1 and 2, so they are not timed). Trainer: ``on_step_begin``
  to ``on_step_end`` (forward, backward, gradient clipping, optimizer, scheduler,
  zero_grad); Lightning: the optimizer's ``step(closure)``. CPU time is the main
  thread's (torch runs one thread here), less moved than wall time by other work.
* **rebuilt**: HF's checkpointed layers, or memfit's units recomputed whole and
  selectively ("sel": the matmul outputs kept, the rest rebuilt); **recompute**: the
  plan's recompute FLOPs as memfit counts them (matmuls and attention; elementwise ops
  count 0, so a selective rebuild counts 0), and their share of an unplanned forward and
  backward (3x the forward's FLOPs).
* **plan s**: wall time of the callback's train-begin hook (profile, plan, the verifying
  measurement, apply), outside every step; ``plan_cache=None``, so every run plans.

    python bench/integrations.py                  # all three tables, about a minute
    python bench/integrations.py --bf16 --steps 20
    python bench/integrations.py --only hf --n-layer 8 --seq 256
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import transformers
from bench_meta import memfit_commit  # bench/bench_meta.py
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.trainer_callback import PrinterCallback

from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.errors import BudgetError
from memfit.integrations import hf as memfit_hf
from memfit.integrations import lightning as memfit_pl
from memfit.units import format_bytes, parse_bytes

MEASURED_STEP = 2
"""The step whose memory is reported: the first that starts with the optimizer state. Step 1
runs under the oracle too: on CPU the profiler sees a free only of memory allocated while
it ran, so the gradients step 2 frees must have been allocated under it (else they would
read as held through step 2)."""


@dataclass(frozen=True)
class Row:
    """One run of a table: its measured peaks and time, and the plan when there is one."""

    label: str
    budget_bytes: float | None
    forward_backward_peak_bytes: int | None
    """Trainer: ``training_step``'s peak; None for Lightning (inside the step window)."""
    step_peak_bytes: int
    """Trainer: the optimizer step's peak; Lightning: the whole step's."""
    predicted_peak_bytes: float | None
    step_seconds: float
    """The median wall time of the timed steps."""
    cpu_seconds: float
    """The median CPU time of the timed steps (the main thread's: torch runs one thread)."""
    recomputed: str
    """What is rebuilt in backward: units recomputed whole, and selectively (memfit: only
    the cheap ops, e.g. the GELU), or HF's checkpointed layers; "-" for none."""
    recompute_flops: float | None
    step_flops: float | None
    """FLOPs of one unplanned forward and backward, as memfit counts them."""
    planning_seconds: float | None
    losses: list[float]

    @property
    def peak_bytes(self) -> int:
        """The step's measured peak: the larger of its windows."""
        return max(self.step_peak_bytes, self.forward_backward_peak_bytes or 0)


@dataclass(frozen=True)
class Table:
    """Rows measured side by side, with what they share."""

    title: str
    rows: list[Row]
    notes: list[str]


@dataclass
class Probe:
    """What one run's hooks measured: step 2's windows, the later steps' times, losses."""

    forward_backward_peak_bytes: int | None = None
    step_peak_bytes: int | None = None
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    cpu_seconds: list[float] = dataclasses.field(default_factory=list)
    checkpointed_layers: int = 0
    """HF rows: the decoder layers whose own checkpointing was on."""
    planning_seconds: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)


def timed_hook(callback: Any, name: str, seconds: list[float]) -> None:
    """Wrap ``callback.name`` in place so each call's wall time goes to ``seconds``
    (both frameworks look their hooks up on the instance)."""
    hook = getattr(callback, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return hook(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(callback, name, timed)


def recomputed(probe: Probe, plan: Any) -> str:
    """What a run rebuilds in backward, in words (:attr:`Row.recomputed`)."""
    if plan is None:
        return f"{probe.checkpointed_layers} layers" if probe.checkpointed_layers else "-"
    whole = sum(d == "recompute" for d in plan.decisions.values())
    whole += sum(len(ranges) for ranges in plan.segments.values())
    selective = sum(d == "selective" for d in plan.decisions.values())
    parts = [f"{whole} unit{'s' * (whole != 1)}"] * bool(whole)
    parts += [f"{selective} sel"] * bool(selective)
    return " + ".join(parts) or "-"


def timed_step(probe: Probe) -> Callable[[], None]:
    """Start timing a step; the returned function ends it (wall and CPU time)."""
    wall, cpu = time.perf_counter(), time.thread_time()

    def end() -> None:
        probe.step_seconds.append(time.perf_counter() - wall)
        probe.cpu_seconds.append(time.thread_time() - cpu)

    return end


def row(label: str, probe: Probe, callback: Any = None, budget: float | None = None) -> Row:
    """The record of a finished run (``callback``: memfit's, when the run had one)."""
    assert probe.step_peak_bytes is not None, "the measured step did not run"
    plan = None if callback is None else callback.plan
    run = None if callback is None else callback.run
    return Row(
        label=label,
        budget_bytes=budget,
        forward_backward_peak_bytes=probe.forward_backward_peak_bytes,
        step_peak_bytes=probe.step_peak_bytes,
        predicted_peak_bytes=None if plan is None else plan.predicted_peak_bytes,
        step_seconds=statistics.median(probe.step_seconds),
        cpu_seconds=statistics.median(probe.cpu_seconds),
        recomputed=recomputed(probe, plan),
        recompute_flops=None if plan is None else plan.recompute_flops,
        step_flops=None if run is None else run.step_flops,
        planning_seconds=sum(probe.planning_seconds) if callback is not None else None,
        losses=probe.losses,
    )


def between(rows: list[Row], fraction: float) -> int:
    """A budget ``fraction`` of the way from the least measured peak of memfit's rows to
    the unplanned run's (the first row)."""
    least = min(r.peak_bytes for r in rows if r.predicted_peak_bytes is not None)
    return int(least + fraction * (rows[0].peak_bytes - least))


# --- Hugging Face Trainer ---------------------------------------------------------------


class Windows(torch.utils.data.Dataset):
    """Fixed random token windows with labels (the model computes its own loss)."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class TrainerProbe(TrainerCallback):
    """Measures the optimizer step of step 2 and times steps 3 and later. Added after
    memfit's callback, so its optimizer is the one the step uses."""

    def __init__(self, probe: Probe, model: nn.Module) -> None:
        self.probe = probe
        self.model = model
        self.inputs: Any = None  # the batch of the step, alive through its optimizer step
        self._end: Callable[[], None] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wrapper = kwargs["optimizer"]  # accelerate's; the Trainer calls its step()
        optimizer = getattr(wrapper, "optimizer", wrapper)
        step = wrapper.step
        model, probe = self.model, self.probe

        def measured(*a: Any, **k: Any) -> Any:
            if state.global_step + 1 > MEASURED_STEP:
                return step(*a, **k)
            # Named inline, so the list holds nothing the step frees.
            peak = allocator_peak(
                lambda: step(*a, **k),
                live=[
                    *model.parameters(),
                    *model.buffers(),
                    *[p.grad for p in model.parameters() if p.grad is not None],
                    *optimizer_tensors(optimizer),
                    self.inputs,
                ],
                live_complete=True,
            )
            if state.global_step + 1 == MEASURED_STEP:
                probe.step_peak_bytes = peak.peak_bytes
            return peak.result

        wrapper.step = measured

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end = timed_step(self.probe) if state.global_step >= MEASURED_STEP else None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._end is not None:
            self._end()


def hf_checkpointing() -> tuple[str, bool]:
    """The installed transformers' name of the Trainer's checkpointing flag
    ("activation_checkpointing" from 5.x, where "gradient_checkpointing" is its deprecated
    alias), and whether its models take ``every_n_layers``."""
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    enable = getattr(GPT2LMHeadModel, "activation_checkpointing_enable", None)
    enable = enable or GPT2LMHeadModel.gradient_checkpointing_enable
    return name, "every_n_layers" in inspect.signature(enable).parameters


def hf_run(
    model: nn.Module, data: Windows, opts: Any, callback: Any = None, **extra_args: Any
) -> Probe:
    """Train ``model`` 2 + ``opts.steps`` steps with the Trainer (``callback``: memfit's;
    ``extra_args``: more TrainingArguments) and return what was measured."""
    probe = Probe()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=opts.batch,
            max_steps=MEASURED_STEP + opts.steps,
            logging_steps=10**6,  # the losses are read from the steps themselves
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=opts.bf16,
            disable_tqdm=True,
            seed=0,
            **extra_args,
        )
        meter = TrainerProbe(probe, model)
        callbacks = [meter] if callback is None else [callback, meter]
        if callback is not None:
            timed_hook(callback, "on_train_begin", probe.planning_seconds)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.remove_callback(PrinterCallback)  # the table says what matters
        plain_step = trainer.training_step

        def training_step(model_: Any, inputs: Any, num_items: Any = None) -> Any:
            meter.inputs = inputs
            if trainer.state.global_step + 1 > MEASURED_STEP:
                loss = plain_step(model_, inputs, num_items)
            else:
                optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
                peak = allocator_peak(
                    lambda: plain_step(model_, inputs, num_items),
                    live=[
                        *model_.parameters(),
                        *model_.buffers(),
                        *[p.grad for p in model_.parameters() if p.grad is not None],
                        *optimizer_tensors(optimizer),
                        inputs,
                    ],
                    live_complete=True,
                )
                if trainer.state.global_step + 1 == MEASURED_STEP:
                    probe.forward_backward_peak_bytes = peak.peak_bytes
                loss = peak.result
            # The loss itself: the Trainer's logs round it to 4 decimals.
            probe.losses.append(float(loss))
            return loss

        trainer.training_step = training_step
        trainer.train()
        probe.checkpointed_layers = sum(
            bool(getattr(m, "gradient_checkpointing", False))
            for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer)
        )
    return probe


def hf_table(opts: Any) -> Table:
    """The Trainer's rows, measured one after another on copies of one model."""
    vocab = 256
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=opts.n_layer,
        n_embd=opts.n_embd,
        n_head=opts.n_head,
        vocab_size=vocab,
        n_positions=opts.seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    base = GPT2LMHeadModel(cfg)
    data = Windows(opts.batch * (MEASURED_STEP + opts.steps), opts.seq, vocab)
    flag, has_every_n = hf_checkpointing()
    rows = [row("no callback", hf_run(copy.deepcopy(base), data, opts))]

    def hf(label: str, **kwargs: Any) -> Row:
        settings = {flag: True, f"{flag}_kwargs": kwargs}
        rows.append(row(label, hf_run(copy.deepcopy(base), data, opts, **settings)))
        return rows[-1]

    def memfit(label: str, budget: float | None = None, **kwargs: Any) -> None:
        # plan_cache=None: every run plans (a cached plan would be read back, not made).
        callback = memfit_hf.MemfitCallback(budget=budget, plan_cache=None, **kwargs)
        try:
            probe = hf_run(copy.deepcopy(base), data, opts, callback)
        except BudgetError as exc:
            notes.append(f"{label}: refused at train begin ({exc})")
            return
        rows.append(row(label, probe, callback, budget))

    notes = [f"HF rows: TrainingArguments({flag}=True, {flag}_kwargs={{...}})."]
    hf_gc = hf("HF checkpointing", use_reentrant=False)
    hf("HF checkpointing, reentrant", use_reentrant=True)
    n = opts.every_n_layers
    if not has_every_n:
        notes.append(
            f"transformers {transformers.__version__} has no every_n_layers for its "
            "checkpointing: no row."
        )
    elif opts.n_layer <= n:
        notes.append(f"every_n_layers={n} needs more than {n} layers: no row.")
    else:
        hf(f"HF checkpointing, every_n_layers={n}", use_reentrant=False, every_n_layers=n)
    memfit("memfit, full", strategy="full")
    memfit("memfit, optimal @ HF's peak", budget=hf_gc.peak_bytes)
    budgets = {f: between(rows, f) for f in (0.3, 0.7)}  # from the rows above, once
    for fraction, budget in budgets.items():
        memfit(f"memfit, optimal @ {fraction:.0%}", budget=budget)
    least = min(r.peak_bytes for r in rows if r.predicted_peak_bytes is not None)
    notes.append(
        f"memfit's least measured peak {least} B, HF checkpointing's {hf_gc.peak_bytes} B "
        f"({least - hf_gc.peak_bytes:+d} B)."
    )
    precision = "bf16 (autocast)" if opts.bf16 else "fp32"
    title = (
        f"Hugging Face Trainer: GPT-2 n_layer={opts.n_layer} n_embd={opts.n_embd}, batch "
        f"{opts.batch} x {opts.seq} tokens, {precision}, AdamW"
    )
    return Table(title, rows, notes)


# --- Lightning ---------------------------------------------------------------------------


def block(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class Stack(pl.LightningModule):
    """docs/integrations.md's Lightning example: blocks and a head, MSE, AdamW."""

    def __init__(self, blocks: int, width: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[block(width, hidden) for _ in range(blocks)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LightningProbe(pl.Callback):
    """Measures the optimizer's ``step(closure)`` of step 2 (the whole step in automatic
    optimization) and times it from step 3 on. Added after memfit's callback."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.batch: Any = None
        self.calls = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizer = trainer.optimizers[0]
        step = optimizer.step
        probe = self.probe

        def measured(*a: Any, **k: Any) -> Any:
            self.calls += 1
            if self.calls > MEASURED_STEP:
                end = timed_step(probe)
                result = step(*a, **k)
                end()
                return result
            peak = allocator_peak(
                lambda: step(*a, **k),
                live=[
                    *pl_module.parameters(),
                    *pl_module.buffers(),
                    *[p.grad for p in pl_module.parameters() if p.grad is not None],
                    *optimizer_tensors(optimizer),
                    self.batch,
                ],
                live_complete=True,
            )
            if self.calls == MEASURED_STEP:
                probe.step_peak_bytes = peak.peak_bytes
            return peak.result

        optimizer.step = measured

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
        self.batch = batch

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        self.probe.losses.append(float(outputs["loss"]))


def lightning_run(
    module: pl.LightningModule, data: Any, opts: Any, precision: str, callback: Any = None
) -> Probe:
    """Fit ``module`` 2 + ``opts.steps`` steps under ``precision`` and return what was
    measured (``callback``: memfit's)."""
    probe = Probe()
    callbacks: list[Any] = [LightningProbe(probe)]
    if callback is not None:
        timed_hook(callback, "on_train_start", probe.planning_seconds)
        callbacks.insert(0, callback)
    trainer = pl.Trainer(
        max_steps=MEASURED_STEP + opts.steps,
        accelerator="cpu",
        devices=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=opts.pl_batch)
    trainer.fit(module, loader)
    return probe


def lightning_table(opts: Any, precision: str) -> Table:
    """Lightning's rows under ``precision``, on copies of one module."""
    torch.manual_seed(0)
    base = Stack(opts.pl_blocks, opts.pl_width, opts.pl_hidden)
    n = opts.pl_batch * (MEASURED_STEP + opts.steps)
    data = torch.utils.data.TensorDataset(torch.randn(n, opts.pl_width), torch.randn(n))
    rows = [row("no callback", lightning_run(copy.deepcopy(base), data, opts, precision))]

    notes = [
        "Lightning has no activation checkpointing of its own for a module on one device "
        "(its FSDP and DeepSpeed strategies have one): no row."
    ]

    def memfit(label: str, budget: float | None = None, **kwargs: Any) -> None:
        callback = memfit_pl.MemfitCallback(budget=budget, plan_cache=None, **kwargs)
        try:
            probe = lightning_run(copy.deepcopy(base), data, opts, precision, callback)
        except BudgetError as exc:
            notes.append(f"{label}: refused at train start ({exc})")
            return
        rows.append(row(label, probe, callback, budget))

    memfit("memfit, full", strategy="full")
    if precision == "bf16-mixed":
        memfit(f"memfit, optimal @ {opts.pl_budget}", budget=parse_bytes(opts.pl_budget))
    fractions = (0.3, 0.7) if precision == "bf16-mixed" else (0.3, 0.5, 0.7)
    budgets = {f: between(rows, f) for f in fractions}  # from the rows above, once
    for fraction, budget in budgets.items():
        memfit(f"memfit, optimal @ {fraction:.0%}", budget=budget)
    title = (
        f'Lightning, precision="{precision}": Stack of {opts.pl_blocks} blocks '
        f"Linear({opts.pl_width},{opts.pl_hidden})-GELU-Linear({opts.pl_hidden},{opts.pl_width}) "
        f"and a head, batch {opts.pl_batch}, AdamW"
    )
    return Table(title, rows, notes)


# --- printing ----------------------------------------------------------------------------


def format_flops(flops: float) -> str:
    """FLOPs in GFLOP (MFLOP below one GFLOP, for small models)."""
    return f"{flops / 1e9:.3g} GF" if flops >= 1e9 or flops == 0 else f"{flops / 1e6:.3g} MF"


def cells(r: Row, first: Row) -> list[str]:
    """One row's printed cells (``first``: the unplanned run, what changes are against)."""
    dash = "-"
    predicted = error = held = recompute = dash
    if r.predicted_peak_bytes is not None:
        predicted = format_bytes(r.predicted_peak_bytes)
        error = f"{r.predicted_peak_bytes / r.peak_bytes - 1:+.1%}"
    if r.budget_bytes is not None:
        held = "yes" if r.peak_bytes <= r.budget_bytes else "NO"
    if r.recompute_flops is not None and r.step_flops:
        recompute = f"{format_flops(r.recompute_flops)}, {r.recompute_flops / r.step_flops:.0%}"
    fwd_bwd = r.forward_backward_peak_bytes
    return [
        r.label,
        dash if r.budget_bytes is None else format_bytes(r.budget_bytes),
        dash if fwd_bwd is None else format_bytes(fwd_bwd),
        format_bytes(r.step_peak_bytes),
        format_bytes(r.peak_bytes),
        dash if r is first else f"{r.peak_bytes / first.peak_bytes - 1:+.1%}",
        predicted,
        error,
        held,
        f"{r.step_seconds * 1e3:.1f}",
        dash if r is first else f"{r.step_seconds / first.step_seconds - 1:+.0%}",
        f"{r.cpu_seconds * 1e3:.1f}",
        dash if r is first else f"{r.cpu_seconds / first.cpu_seconds - 1:+.0%}",
        r.recomputed,
        recompute,
        dash if r.planning_seconds is None else f"{r.planning_seconds:.2f}",
    ]


HEADER = [
    "run",
    "budget",
    "fwd+bwd",
    "opt step",
    "peak",
    "vs none",
    "predicted",
    "pred err",
    "held",
    "step ms",
    "vs none",
    "cpu ms",
    "vs none",
    "rebuilt",
    "recompute",
    "plan s",
]
WIDTHS = [30, 10, 10, 10, 10, 8, 10, 8, 5, 8, 8, 8, 8, 16, 15, 7]


def print_table(table: Table, markdown: bool) -> None:
    """The table as aligned text (or Markdown), then its notes."""
    first = table.rows[0]
    lines = [HEADER, *[cells(r, first) for r in table.rows]]
    widths = WIDTHS
    if first.forward_backward_peak_bytes is None:  # Lightning: one window, the whole step
        keep = [i for i in range(len(HEADER)) if HEADER[i] not in ("fwd+bwd", "opt step")]
        lines = [[line[i] for i in keep] for line in lines]
        widths = [WIDTHS[i] for i in keep]
    print(table.title)
    if markdown:
        print("| " + " | ".join(lines[0]) + " |")
        print("|---|" + "---:|" * (len(lines[0]) - 1))
        for line in lines[1:]:
            print("| " + " | ".join(line) + " |")
    else:
        for line in lines:
            text = [
                f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(line, widths))
            ]
            print(" ".join(text))
    same = all(r.losses == first.losses for r in table.rows)
    print(f"losses of every run bitwise equal: {same} ({len(first.losses)} steps)")
    for note in table.notes:
        print(f"note: {note}")
    print()


def quiet_frameworks() -> None:
    """The frameworks' info lines and known warnings off: the tables say what matters."""
    for name in ("lightning.pytorch", "lightning.fabric", "memfit.integrations"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*The number of training batches.*")
    # The probes wrap optimizer.step after the Trainer's scheduler was made; it still steps.
    warnings.filterwarnings("ignore", message=".*optimizer.step\\(\\)` has been overridden.*")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["hf", "lightning"], help="one framework's tables")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the measured one")
    parser.add_argument("--markdown", action="store_true", help="tables as Markdown")
    hf = parser.add_argument_group("Hugging Face Trainer")
    hf.add_argument("--n-layer", type=int, default=4)
    hf.add_argument("--n-embd", type=int, default=64)
    hf.add_argument("--n-head", type=int, default=4)
    hf.add_argument("--seq", type=int, default=128)
    hf.add_argument("--batch", type=int, default=8)
    hf.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True)")
    hf.add_argument("--every-n-layers", type=int, default=2)
    lt = parser.add_argument_group("Lightning")
    lt.add_argument("--pl-blocks", type=int, default=8)
    lt.add_argument("--pl-width", type=int, default=128)
    lt.add_argument("--pl-hidden", type=int, default=512)
    lt.add_argument("--pl-batch", type=int, default=256)
    lt.add_argument("--pl-budget", default="19MiB", help="the bf16-mixed table's fixed budget")
    lt.add_argument("--precisions", default="bf16-mixed,32-true")
    opts = parser.parse_args(argv)
    if opts.steps < 1:
        parser.error(f"--steps {opts.steps}: at least 1 step is timed after the measured one")
    torch.set_num_threads(1)
    quiet_frameworks()
    tables = []
    if opts.only != "lightning":
        tables.append(hf_table(opts))
    if opts.only != "hf":
        tables += [lightning_table(opts, p) for p in opts.precisions.split(",")]
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, lightning "
        f"{lightning.__version__}, 1 thread, CPU; memfit {memfit_commit()}; peak: step "
        f"{MEASURED_STEP}'s, step ms: median of steps {MEASURED_STEP + 1}-"
        f"{MEASURED_STEP + opts.steps}\n"
    )
    for table in tables:
        print_table(table, opts.markdown)


if __name__ == "__main__":
    main()
