"""Checkpoint plans under torch.compile: peak memory, recomputed FLOPs and step time of a
planned GPT, eager against compiled, on CPU in fp32.

Plans: ``none``, ``full`` (every block recomputed), ``uniform:2`` (segments of two
blocks) and ``selective`` (every block keeps its matmul outputs). Each is applied to the
uncompiled model and then compiled (precision -> plan -> compile). Per row:

* peak: the allocator's peak of one training step (``memfit.allocator.allocator_peak``),
  after warm-up steps (compilation happens there);
* recomputed FLOPs: the step's FLOPs less the unplanned step's. Eager steps are counted by
  ``flop_counter`` as they run; compiled ones from the forward and backward graphs
  AOTAutograd's min-cut partitioner produced (``aot_eager``: the partition a compiled step
  runs; the inductor rows use the same partitioner, so they are not counted again);
* step: the median of ``--steps`` timed steps.

    python bench/compile.py                          # the table in docs/planner.md
    python bench/compile.py --backends aot_eager     # without inductor's C++ compilation
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

import memfit
from memfit.allocator import allocator_peak
from memfit.checkpoint.profiler import flop_counter
from memfit.checkpoint.profiler.flops import FLOP_REGISTRY
from memfit.checkpoint.tree import find_units
from memfit.units import format_bytes

from gpt_setup import add_gpt_arguments, build_gpt


def graph_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of the matmul-like ops of a traced aten graph, from its nodes' fake values."""

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op, args, out = node.target, node.args, node.meta.get("val")
        # Random ops the partitioner may recompute run inside RNG-replaying wrappers
        # (CPU attention counts as one: it takes a dropout probability).
        if str(op) == "run_and_save_rng_state":
            op, args, out = args[0], args[1:], (out or (None, None))[1]
        elif str(op) == "run_with_rng_state":
            op, args = args[1], args[2:]
        formula = FLOP_REGISTRY.get(getattr(op, "overloadpacket", None))
        if formula is None:
            continue
        args = torch.fx.node.map_aggregate(args, val)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
        total += int(formula(*args, **kwargs, out_val=out))
    return total


class CountingBackend:
    """``aot_eager`` with the min-cut partitioner, keeping its graphs' FLOPs."""

    def __init__(self) -> None:
        self.flops = 0

    def _count(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.flops += graph_flops(gm)
        return make_boxed_func(gm)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return aot_autograd(
            fw_compiler=self._count,
            bw_compiler=self._count,
            partition_fn=min_cut_rematerialization_partition,
        )(gm, example_inputs)


def measure(
    model: torch.nn.Module, loss_fn: Any, batch: torch.Tensor, steps: int, count_eager: bool
) -> tuple[int, int, float]:
    """(allocator peak of a step, FLOPs of an eager step or 0, median step seconds)."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()

    for _ in range(2):  # warm-up: compilation, allocator pools
        step()
    model.zero_grad(set_to_none=True)
    live = [*model.parameters(), *model.buffers(), batch]
    peak = allocator_peak(lambda: loss_fn(model, batch).backward(), live=live).peak_bytes
    flops = 0
    if count_eager:
        with flop_counter() as fc:
            step()
        flops = int(fc.get_total_flops())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return int(peak), flops, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_arguments(parser, n_layer=4, n_embd=64, n_head=4, block_size=128, batch_size=8)
    parser.add_argument("--steps", type=int, default=11, help="timed steps per row")
    parser.add_argument("--backends", default="aot_eager,inductor")
    args = parser.parse_args()
    torch.set_num_threads(1)  # steadier times on a small model
    model, loss_fn, batch_fn = build_gpt(args)
    batch = batch_fn(args.batch_size, generator=0)
    blocks = [n for n in find_units(model).names() if n.startswith("blocks.")]
    plans: dict[str, Any] = {
        "none": {},
        "full": {n: "recompute" for n in blocks},
        "uniform:2": {
            "decisions": {},
            "segments": {"blocks": [(i, i + 1) for i in range(0, len(blocks) - 1, 2)]},
        },
        "selective": {n: "selective" for n in blocks},
    }
    print(
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd} block_size={args.block_size} "
        f"batch={args.batch_size}, fp32, CPU, 1 thread, torch {torch.__version__}"
    )
    print(f"{'mode':<10} {'plan':<10} {'peak':>10} {'recomputed':>12} {'step':>9}")
    base_flops: dict[str, int] = {}
    for mode in ["eager", *args.backends.split(",")]:
        for name, plan in plans.items():
            torch._dynamo.reset()
            planned = memfit.apply_plan(copy.deepcopy(model), plan)
            counter = CountingBackend() if mode == "aot_eager" else None
            run = planned
            if mode != "eager":
                run = torch.compile(planned, backend=counter or mode)
            peak, flops, seconds = measure(run, loss_fn, batch, args.steps, mode == "eager")
            if counter is not None:
                flops = counter.flops
            recomputed = "-"
            if mode in ("eager", "aot_eager"):
                base_flops.setdefault(mode, flops)
                recomputed = f"{(flops - base_flops[mode]) / 1e6:.1f} MFLOP"
            print(
                f"{mode:<10} {name:<10} {format_bytes(peak):>10} {recomputed:>12} "
                f"{seconds * 1e3:>7.1f}ms"
            )


if __name__ == "__main__":
    main()
