"""Data-parallel training of the built-in GPT through memfit: step time and per-rank peak
memory on 1 and 2 processes under DDP and FSDP2, and the planner's per-rank prediction
against the measured peak.

Each rank trains its slice of the same global batch (``--batch-size`` in all) with the
Engine over ``memfit.parallelize``; the step time is the median of ``--steps`` steps after
two warm-up steps (the slowest rank's); the peak is the allocator's over one warm step
(``memfit.allocator.allocator_peak``: on CPU torch's profiler, from the weights, optimizer
state and DDP's gradient buckets alive before it); the prediction is ``memfit.plan``'s for
one rank (``world_size``, ``data_parallel``, no checkpointing) on a plain copy of the model.

CPU (gloo, one thread per process): ``python bench/distributed.py``. Several GPUs (nccl, one
per process): ``python bench/distributed.py --backend nccl --device cuda --nproc 8``.
The numbers are in docs/distributed.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from gpt_setup import add_gpt_arguments, build_gpt  # noqa: E402


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rank(rank: int, world: int, kind: str, args: argparse.Namespace, out: str) -> None:
    import memfit
    from memfit.allocator import allocator_peak
    from memfit.checkpoint.api import make_plan
    from memfit.distributed import shard_batch
    from memfit.nested import tensors

    torch.set_num_threads(args.threads)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        args.backend,
        init_method=f"file://{out}.store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    model, loss_fn, batch_fn = build_gpt(args)
    model.to(device)

    def batch(step: int) -> Any:
        b = batch_fn(args.batch_size, generator=step)
        return shard_batch(b.to(device) if isinstance(b, torch.Tensor) else b)

    def optimizer_of(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)

    # The prediction: a plain copy of the model, one rank's micro-batch.
    copy, _, _ = build_gpt(args)
    copy.to(device)
    predicted = make_plan(
        copy,
        batch(0),
        loss_fn,
        optimizer=optimizer_of(copy),
        precision=args.precision,
        strategy="none",
        world_size=world,
        data_parallel=None if kind == "none" else kind,
        frontier=False,
    ).plan.predicted_peak_bytes
    del copy
    if kind != "none":
        model = memfit.parallelize(model, data_parallel=kind, precision=args.precision)
    optimizer = optimizer_of(model)
    engine = memfit.Engine(model, optimizer, precision=args.precision, monitor=False)
    for step in range(2):
        engine.train_step(batch(step), loss_fn)
    times = []
    for step in range(2, 2 + args.steps):
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(batch(step), loss_fn)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    params = [_local(p) for p in model.parameters()]
    state = [_local(t) for t in tensors(list(optimizer.state.values()))]
    live = [*params, *model.buffers(), *state]
    buckets = 0
    if kind == "ddp":  # DDP's gradient buckets, allocated when it wrapped the model
        buckets = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    b = batch(99)
    peak = allocator_peak(lambda: engine.train_step(b, loss_fn), live=[*live, b], device=device)
    result = {
        "step_seconds": statistics.median(times),
        "peak_bytes": peak.peak_bytes + buckets,
        "predicted_bytes": float(predicted),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
    }
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(world: int, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration on ``world`` processes; the ranks' results combined."""
    out = os.path.join(tempfile.mkdtemp(), "run")
    mp.start_processes(_rank, args=(world, kind, args, out), nprocs=world, start_method="spawn")
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]
    return {
        "step_seconds": max(r["step_seconds"] for r in ranks),
        "peak_bytes": max(r["peak_bytes"] for r in ranks),
        "predicted_bytes": max(r["predicted_bytes"] for r in ranks),
        "param_bytes": max(r["param_bytes"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_arguments(parser, n_layer=4, n_embd=256, n_head=4, block_size=128, batch_size=16)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configs = [(1, "none"), (args.nproc, "ddp"), (args.nproc, "fsdp")]
    rows = []
    for world, kind in configs:
        r = run(world, kind, args)
        rows.append({"processes": world, "data_parallel": kind, **r})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    base = rows[0]["step_seconds"]
    mib = 2**20
    print(
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd} block={args.block_size}, global "
        f"batch {args.batch_size}, {args.precision}, {args.backend}/{args.device}, "
        f"{args.threads} thread(s) per process"
    )
    print(
        "| processes | data parallel | step s | vs 1 process | params/rank MiB | peak/rank MiB "
        "| predicted MiB | predicted/measured |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['processes']} | {r['data_parallel']} | {r['step_seconds']:.3f} | "
            f"{r['step_seconds'] / base:.2f}x | {r['param_bytes'] / mib:.2f} | "
            f"{r['peak_bytes'] / mib:.2f} | {r['predicted_bytes'] / mib:.2f} | "
            f"{r['predicted_bytes'] / r['peak_bytes']:.3f} |"
        )


if __name__ == "__main__":
    main()
