"""Peak memory of a Hugging Face Trainer step with and without memfit's plan.

The same tiny GPT-2 (built from a config) is trained by the same ``Trainer`` settings, once
without a callback and once with ``MemfitCallback`` per strategy. In each run one step's
forward and backward (the Trainer's ``training_step``, after the optimizer state exists)
is measured by memfit's allocator oracle, ``memfit.allocator.allocator_peak`` (on CPU,
torch.profiler's memory events), counting the parameters, optimizer state and batch alive
when it starts. Planning happens at train begin, outside the measured step.

    python bench/integrations.py                 # a few seconds on CPU
    python bench/integrations.py --n-layer 8 --seq 256
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.integrations.hf import MemfitCallback
from memfit.units import format_bytes


@dataclass(frozen=True)
class Measured:
    """One Trainer run: what was planned and what the measured step peaked at."""

    label: str
    predicted_peak_bytes: float | None
    measured_peak_bytes: int
    recomputed_units: int
    losses: list[float]


class Windows(torch.utils.data.Dataset):
    """Fixed random token windows with labels (the model computes its own loss)."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run(model: torch.nn.Module, data: Windows, opts: Any, callback: MemfitCallback | None) -> Any:
    """Train ``opts.steps`` steps; return (peak of step ``opts.steps``, losses)."""
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=opts.batch,
            max_steps=opts.steps,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=data, callbacks=[callback] * bool(callback)
        )
        trainer.remove_callback(PrinterCallback)  # the table below says what matters
        plain_step = trainer.training_step
        peaks: list[int] = []

        def training_step(model_: Any, inputs: Any, num_items: Any = None) -> Any:
            if trainer.state.global_step + 1 < opts.steps:
                return plain_step(model_, inputs, num_items)
            optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            live = [*model_.parameters(), *model_.buffers(), *optimizer_tensors(optimizer), inputs]
            peak = allocator_peak(lambda: plain_step(model_, inputs, num_items), live=live)
            peaks.append(peak.peak_bytes)
            return peak.result

        trainer.training_step = training_step
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return peaks[0], losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="the last one is measured")
    opts = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocab = 256
    cfg = GPT2Config(
        n_layer=opts.n_layer,
        n_embd=opts.n_embd,
        n_head=4,
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
    data = Windows(opts.batch * opts.steps, opts.seq, vocab)
    peak, losses = run(copy.deepcopy(base), data, opts, None)
    results = [Measured("no callback", None, peak, 0, losses)]

    def planned(label: str, **kwargs: Any) -> Measured:
        callback = MemfitCallback(measure_memory=False, verbose=False, **kwargs)
        peak, losses = run(copy.deepcopy(base), data, opts, callback)
        plan = callback.plan
        recomputed = sum(d != "keep" for d in plan.decisions.values())
        results.append(Measured(label, plan.predicted_peak_bytes, peak, recomputed, losses))
        return results[-1]

    none = planned("memfit, strategy none", strategy="none")
    full = planned("memfit, strategy full", strategy="full")
    # A budget half-way between the unplanned step and 'full', for the optimal plan.
    budget = int((none.predicted_peak_bytes + full.predicted_peak_bytes) / 2)
    planned(f"memfit, optimal, {format_bytes(budget)}", budget=budget)
    print(
        f"GPT-2 n_layer={opts.n_layer} n_embd={opts.n_embd}, batch {opts.batch} x {opts.seq} "
        f"tokens, fp32, AdamW, CPU; step {opts.steps}'s forward and backward"
    )
    print(f"{'run':<28} {'measured peak':>14} {'vs no plan':>11} {'predicted':>11} {'units':>6}")
    for r in results:
        predicted = "-" if r.predicted_peak_bytes is None else format_bytes(r.predicted_peak_bytes)
        change = r.measured_peak_bytes / results[0].measured_peak_bytes - 1
        print(
            f"{r.label:<28} {format_bytes(r.measured_peak_bytes):>14} {change:>+11.1%} "
            f"{predicted:>11} {r.recomputed_units:>6}"
        )
    same = all(r.losses == results[0].losses for r in results)
    print(f"losses of every run bitwise equal: {same}")


if __name__ == "__main__":
    main()
