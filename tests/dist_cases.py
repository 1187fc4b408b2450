"""Two gloo processes on CPU for the data-parallel tests, and the model they train.

``launch(fn, tmp_path)`` starts ``world_size`` spawned processes that join one gloo group
(a FileStore in ``tmp_path``, 60 s timeout), runs ``fn(rank, world_size, tmp_path)`` in
each and returns each rank's outcome; a process still running after ``timeout`` seconds is
killed and reported, so a test cannot hang.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Imported before any group exists, as memfit's init_from_env does: imported after it (DDP
# does), its functions' default arguments hold the group and destroy_process_group cannot
# free it.
import torch.distributed.nn.functional  # noqa: F401
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def _entry(fn: Callable[..., Any], rank: int, world_size: int, directory: str) -> None:
    torch.set_num_threads(1)
    os.environ.pop("WORLD_SIZE", None)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{directory}/store",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        outcome = {"ok": True, "result": fn(rank, world_size, Path(directory))}
    except BaseException as exc:
        outcome = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "type": type(exc).__name__,
            "traceback": traceback.format_exc(),
        }
    Path(directory, f"rank{rank}.json").write_text(json.dumps(outcome))
    if outcome["ok"]:
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any], tmp_path: Path, world_size: int = 2, timeout: float = 120.0
) -> list[dict[str, Any]]:
    """Run ``fn`` on ``world_size`` ranks; each rank's ``{"ok", "result" | "error"}``."""
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, str(tmp_path)))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    outcomes = []
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            outcomes.append({"ok": False, "error": f"rank {rank} still ran after {timeout} s"})
            continue
        path = tmp_path / f"rank{rank}.json"
        if not path.exists():
            outcomes.append({"ok": False, "error": f"rank {rank} exited {p.exitcode}, no result"})
        else:
            outcomes.append(json.loads(path.read_text()))
    return outcomes


def results(outcomes: list[dict[str, Any]]) -> list[Any]:
    """Each rank's result; fails with the ranks' tracebacks when one raised."""
    failed = [o for o in outcomes if not o["ok"]]
    assert not failed, "\n".join(o.get("traceback", o["error"]) for o in failed)
    return [o["result"] for o in outcomes]


class Spike(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``mult`` (inf overflows it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mult)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (mult,) = ctx.saved_tensors
        return grad * mult.to(grad.dtype), None


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc(F.gelu(self.ln(h)))


class Toy(nn.Module):
    """``inp`` first (its gradient rows 4..7 sit on rank 1 under FSDP2), two blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(8), Block(8)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
        h = Spike.apply(self.inp(x), mult)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def toy_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, mult, y = batch
    return F.mse_loss(model(x, mult).float(), y)


def toy_batch(step: int, size: int = 8, spike_rows: tuple[int, ...] = ()) -> tuple:
    """A global batch; ``spike_rows``: samples whose gradient into ``inp`` row 6 is inf."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 4, generator=g)
    y = torch.randn(size, 2, generator=g)
    mult = torch.ones(size, 8)
    for row in spike_rows:
        mult[row, 6] = float("inf")
    return x, mult, y


def toy_model() -> Toy:
    torch.manual_seed(0)
    return Toy()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full fp32 tensor (DTensor shards gathered), plain-model names."""
    from torch.distributed.tensor import DTensor

    from memfit.distributed import local_module

    out = {}
    for name, p in local_module(model).named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().float().clone()
    return out
