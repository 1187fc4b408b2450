"""Activation storage against keeping and recomputing: what the end of forward holds
(the allocator's count), the gradient error, the step time, and what the planner chooses
at a budget where keeping everything does not fit (docs/tiers.md's tables).

Per model (a GPT and a ResNet in fp32 and bf16-mixed) and storage (keep, bf16, fp8: every
block stored, nothing recomputed; the ResNet also with its stages stored, the planner's
units): the bytes held at the end of forward above the
parameters and the batch, the relative L2 error of the gradients against the exact step
(same dropout masks), and the median step time over interleaved rounds. Then
``memfit.plan`` at 75% of the unplanned step's predicted peak, with and without
``activation_storage``: the recompute each plan needs, its predicted and measured peak.

With ``--convergence``: the built-in GPT and LSTM (``memfit train``'s defaults, fp32,
AdamW, the standard-library corpus) trained from the same seed on the same batches with
every block's activations kept, in bf16 and in fp8, and each final validation loss
against the kept run's (limit: 2%).

    python bench/storage.py                   # the tables in docs/tiers.md
    python bench/storage.py --convergence     # the fidelity table in docs/tiers.md
    python bench/storage.py --cuda            # offload on a GPU (bench/gpu_checks.sh)
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import memfit
from memfit.allocator import allocator_peak
from memfit.checkpoint.api import make_plan
from memfit.checkpoint.storage import apply_storage, remove_storage
from memfit.cli.train_command import lr_lambda
from memfit.models import GPT, GPTConfig, ResNet, ResNetConfig, build_model
from memfit.models.gpt import gpt_loss

Loss = Callable[[nn.Module, Any], torch.Tensor]


def _gpt() -> tuple[nn.Module, torch.Tensor, Loss, list[str]]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=0.1)

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        logits = m(x)
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1))

    return GPT(cfg), torch.randint(0, 512, (8, 128)), loss, [f"blocks.{i}" for i in range(4)]


def _resnet() -> tuple[nn.Module, torch.Tensor, Loss, list[str]]:
    torch.manual_seed(0)
    model = ResNet(ResNetConfig())
    blocks = [n for n, m in model.named_modules() if type(m).__name__ == "BasicBlock"]
    x = torch.randn(32, 3, 32, 32)
    y = torch.randint(0, 10, (32,))
    return model, x, lambda m, b: nn.functional.cross_entropy(m(b), y), blocks


def _resnet_stages() -> tuple[nn.Module, torch.Tensor, Loss, list[str]]:
    """The ResNet with its stages stored, the units the planner offers storage for (the
    children of its outermost chain): a block's input and output, held by its neighbour
    when each block is stored alone, are inside a stage."""
    model, x, loss, _ = _resnet()
    return model, x, loss, [f"stages.{i}" for i in range(len(model.stages))]


def _grads(model: nn.Module, x: Any, loss: Loss, autocast: Any) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with autocast():
        value = loss(model, x)
    value.backward()
    return [p.grad.float().clone() for p in model.parameters()]


def _held(model: nn.Module, x: Any, loss: Loss, autocast: Any) -> int:
    def forward() -> torch.Tensor:
        torch.manual_seed(1)
        with autocast():
            return loss(model, x)

    forward()
    peak = allocator_peak(forward, live=[*model.parameters(), x], live_complete=True)
    return int(peak.end_bytes - peak.start_bytes)


def _error(got: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    diff = sum(float((a - b).pow(2).sum()) for a, b in zip(got, exact))
    return (diff / sum(float(b.pow(2).sum()) for b in exact)) ** 0.5


def _median_times(
    model: nn.Module,
    blocks: list[str],
    kinds: tuple[str, ...],
    step: Callable[[], Any],
    rounds: int,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """The median time of ``step`` with every block stored as each of ``kinds``, over
    ``rounds`` interleaved rounds (the machine's drift hits each storage alike); ``sync``
    waits for queued device work before each clock read."""
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind in kinds:
            apply_storage(model, {b: kind for b in blocks})
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times[kind].append(time.perf_counter() - t0)
            remove_storage(model)
    return {k: statistics.median(v) for k, v in times.items()}


def storage_table(rounds: int) -> None:
    print(
        "| model | precision | storage | held at end of forward | vs keep | gradient error | step time | vs keep |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    models = (
        ("GPT 4x256 b8", _gpt),
        ("ResNet-20 b32, blocks", _resnet),
        ("ResNet-20 b32, stages", _resnet_stages),
    )
    for name, build in models:
        for precision in ("fp32", "bf16-mixed"):
            model, x, loss, blocks = build()
            policy = memfit.PrecisionPolicy(precision)

            def autocast(policy: Any = policy) -> Any:
                return policy.autocast("cpu")

            exact = _grads(model, x, loss, autocast)
            kinds = ("keep", "bf16", "int8", "fp8")
            held, errors = {}, {}
            for kind in kinds:
                apply_storage(model, {b: kind for b in blocks})
                held[kind] = _held(model, x, loss, autocast)
                errors[kind] = _error(_grads(model, x, loss, autocast), exact)
                remove_storage(model)
            step = functools.partial(_grads, model, x, loss, autocast)
            times = _median_times(model, blocks, kinds, step, rounds)
            base_t = times["keep"]
            for kind in kinds:
                t = times[kind]
                print(
                    f"| {name} | {precision} | {kind} | {held[kind] / 2**20:.2f} MiB | "
                    f"{held[kind] / held['keep'] - 1:+.0%} | {errors[kind]:.2e} | "
                    f"{t * 1e3:.1f} ms | {t / base_t:.2f}x |"
                )


def planner_table() -> None:
    """``memfit.plan`` at 75% of the unplanned peak, with and without coded storage, with
    counted costs (FLOPs and bytes: coding counted in passes over its bytes) and measured
    ones (this machine's recompute and coding times)."""
    print()
    print(
        "| model | costs | plan at 75% of the unplanned peak | stored | recompute | "
        "predicted | measured |"
    )
    print("|---|---|---|---|---:|---:|---:|")
    for name, build in (("GPT 4x256 b8", _gpt), ("ResNet-20 b32", _resnet)):
        model, x, loss, _ = build()
        opt = torch.optim.AdamW(model.parameters())
        for costs in ("counted", "measured"):

            def plan(model=model, x=x, loss=loss, opt=opt, costs=costs, **kw: Any) -> memfit.Plan:
                return make_plan(
                    model, x, loss, precision="fp32", optimizer=opt, costs=costs, **kw
                ).plan

            budget = int(plan().predicted_peak_bytes * 0.75)
            for label, storage in (
                ("keep / recompute", ("keep", "recompute")),
                ("+ bf16, int8, fp8", ("keep", "recompute", "bf16", "int8", "fp8")),
            ):
                p = plan(budget=budget, activation_storage=storage)
                kinds = ", ".join(sorted(set(p.storage.values()))) or "-"
                measured = p.measured_peak_bytes or float("nan")
                print(
                    f"| {name} | {costs} | {label} | {len(p.storage)} unit(s) {kinds} | "
                    f"{p.recompute_flops / 1e9:.3f} GFLOP | "
                    f"{p.predicted_peak_bytes / 2**20:.2f} MiB | {measured / 2**20:.2f} MiB "
                    f"({p.predicted_peak_bytes / measured - 1:+.1%}) |",
                    flush=True,
                )


def _train(name: str, storage: str, steps: int, eval_batches: int) -> float:
    """The final validation loss of ``name`` trained ``steps`` steps with every block's
    activations stored as ``storage``: fp32 and ``memfit train``'s recipe (AdamW lr 1e-3,
    weight decay 0.1, betas 0.9/0.95, 20 warm-up steps then cosine, clipping at 1.0,
    batch 16), the same seed and data for every storage."""
    torch.manual_seed(0)
    built = build_model(name)
    model = built.model
    blocks = (
        [f"blocks.{i}" for i in range(len(model.blocks))]
        if name == "gpt"
        else [f"layers.{i}" for i in range(len(model.layers))]
    )
    apply_storage(model, {b: storage for b in blocks})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(20, steps))
    engine = memfit.Engine(
        model,
        opt,
        precision="fp32",
        checkpoint="none",
        clip_grad_norm=1.0,
        lr_scheduler=schedule,
        monitor=False,
    )
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        engine.train_step(built.batch_fn(16, generator=data), built.loss_fn)
    remove_storage(model)
    val = torch.Generator().manual_seed(2)
    model.eval()
    with torch.no_grad():
        losses = [
            float(built.loss_fn(model, built.batch_fn(16, generator=val, split="val")))
            for _ in range(eval_batches)
        ]
    return statistics.fmean(losses)


def convergence_table(steps: int, eval_batches: int) -> None:
    print(f"| model | storage | final validation loss ({steps} steps) | vs keep |")
    print("|---|---|---:|---:|")
    for name in ("gpt", "lstm"):
        base = None
        for storage in ("keep", "bf16", "int8", "fp8"):
            loss = _train(name, storage, steps, eval_batches)
            base = loss if base is None else base
            print(f"| {name} | {storage} | {loss:.4f} | {loss / base - 1:+.2%} |", flush=True)


def cuda_table(rounds: int) -> None:
    """Offload on a GPU beside keep, int8 and fp8 (every block stored): the bytes the CUDA
    allocator holds at the end of forward above the parameters and the batch, whether the
    gradients' relative L2 error against a kept step (CUDA's backward kernels accumulate
    in no fixed order, so keep's own row is the floor), and the median step time
    (synchronized)."""
    print(torch.cuda.get_device_name(0))
    print(
        "| model | precision | storage | held at end of forward | vs keep | gradient error "
        "| step time | vs keep |"
    )
    print("|---|---|---|---:|---:|---|---:|---:|")
    for precision in ("fp32", "bf16-mixed"):
        _cuda_rows(precision, rounds)


def _cuda_rows(precision: str, rounds: int) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=1024, n_layer=8, n_head=16, n_embd=1024)
    model = GPT(cfg).to(device)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), device=device)
    blocks = [f"blocks.{i}" for i in range(cfg.n_layer)]
    policy = memfit.PrecisionPolicy(precision)

    def forward() -> torch.Tensor:
        with policy.autocast("cuda"):
            return gpt_loss(model, x)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        forward().backward()
        return [p.grad.float().clone() for p in model.parameters()]

    exact = grads()
    kinds = ("keep", "offload", "int8", "fp8")
    held, errors = {}, {}
    for kind in kinds:
        apply_storage(model, {b: kind for b in blocks})
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = forward()
        torch.cuda.synchronize()
        held[kind] = torch.cuda.memory_allocated() - before
        del loss
        got = grads()
        errors[kind] = _error(got, exact)
        remove_storage(model)
    times = _median_times(model, blocks, kinds, grads, rounds, sync=torch.cuda.synchronize)
    base_t = times["keep"]
    for kind in kinds:
        t = times[kind]
        print(
            f"| GPT 8x1024 b8 | {precision} | {kind} | {held[kind] / 2**20:.1f} MiB | "
            f"{held[kind] / held['keep'] - 1:+.0%} | {errors[kind]:.1e} "
            f"| {t * 1e3:.1f} ms | {t / base_t:.2f}x |"
        )


def cuda_planner_table() -> None:
    """``memfit.plan`` on the GPU at 75% of the unplanned step's predicted peak, with
    keep/recompute alone and with bf16, fp8 and offload: the plan, its predicted peak and
    the CUDA caching allocator's peak of a whole AdamW step under it (``zero_grad``,
    forward, backward, ``step``; the optimizer's state made by a step before), counted
    from the memory allocated before the model was built."""
    print()
    print(
        "| model | precision | plan at 75% of the unplanned peak | stored | recompute "
        "| predicted | measured (CUDA allocator) |"
    )
    print("|---|---|---|---|---:|---:|---:|")
    for precision in ("fp32", "bf16-mixed"):
        for label, storage in (
            ("keep / recompute", ("keep", "recompute")),
            (
                "+ bf16, int8, fp8, offload",
                ("keep", "recompute", "bf16", "int8", "fp8", "offload"),
            ),
        ):
            print(_cuda_plan_row(precision, label, storage), flush=True)


def _cuda_plan_row(
    precision: str,
    label: str,
    storage: tuple[str, ...],
    cfg: GPTConfig | None = None,
    device: str = "cuda",
) -> str:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    cfg = cfg or GPTConfig(vocab_size=512, block_size=1024, n_layer=8, n_head=16, n_embd=1024)
    model = GPT(cfg).to(device)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), device=device)
    opt = torch.optim.AdamW(model.parameters())
    policy = memfit.PrecisionPolicy(precision)
    if precision != "fp32":  # memfit's fp32 islands, as the Engine trains and plan plans
        memfit.precision.apply_precision(model, policy)

    def plan(**kw: Any) -> memfit.Plan:
        return make_plan(
            model, x, gpt_loss, precision=policy, optimizer=opt, costs="counted", **kw
        ).plan

    budget = int(plan().predicted_peak_bytes * 0.75)
    p = plan(budget=budget, activation_storage=storage)
    memfit.apply_plan(model, p)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with policy.autocast(device):
            loss = gpt_loss(model, x)
        loss.backward()
        opt.step()

    step()  # the optimizer's state, before the measured step
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    memfit.remove_plan(model)
    memfit.precision.remove_precision(model)
    kinds = ", ".join(sorted(set(p.storage.values()))) or "-"
    return (
        f"| GPT {cfg.n_layer}x{cfg.n_embd} b8 | {precision} | {label} | {len(p.storage)} blocks {kinds} | "
        f"{p.recompute_flops / 1e9:.1f} GFLOP | {p.predicted_peak_bytes / 2**30:.3f} GiB | "
        f"{measured / 2**30:.3f} GiB ({p.predicted_peak_bytes / measured - 1:+.1%}) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per storage")
    parser.add_argument("--convergence", action="store_true", help="the fidelity table")
    parser.add_argument("--steps", type=int, default=300, help="training steps (--convergence)")
    parser.add_argument("--eval-batches", type=int, default=32, help="validation batches")
    parser.add_argument("--cuda", action="store_true", help="offload on a GPU (gpu_checks.sh)")
    args = parser.parse_args()
    if args.cuda:
        cuda_table(args.rounds)
        cuda_planner_table()
        return
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, capability {torch.backends.cpu.get_cpu_capability()}"
    )
    if args.convergence:
        convergence_table(args.steps, args.eval_batches)
        return
    storage_table(args.rounds)
    planner_table()


if __name__ == "__main__":
    main()
