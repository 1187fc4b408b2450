"""Synthetic cost trees for the solver's tests and its speed benchmark (bench/solver.py).

Example::

    from cost_trees import gpt_like, flat_chain
    root = gpt_like(48)            # 48 blocks of 19 units
    chain = flat_chain(1000, True)  # a sequential chain of 1,000 equal layers
"""

from __future__ import annotations

import random

from memfit.checkpoint.costs import UnitCost


def gpt_like(n_blocks: int = 12, sequential: bool = False) -> UnitCost:
    """embedding, n blocks (attention and MLP with leaves), final norm, head."""
    mib = float(2**20)

    def leaf(name: str, saved: float, seconds: float, matmul: bool = False) -> UnitCost:
        return UnitCost(
            name,
            own_saved_bytes=saved * mib,
            input_bytes=4 * mib,
            fwd_seconds=seconds,
            fwd_flops=seconds * 1e12,
            matmul_saved_bytes=saved * mib if matmul else 0.0,
            non_matmul_fwd_seconds=0.0,
        )

    def group(name: str, kids: list[UnitCost]) -> UnitCost:
        return UnitCost(
            name,
            children=kids,
            input_bytes=4 * mib,
            fwd_seconds=sum(k.fwd_seconds for k in kids),
            fwd_flops=sum(k.fwd_flops for k in kids),
            matmul_saved_bytes=sum(k.matmul_saved_bytes for k in kids),
            non_matmul_fwd_seconds=0.3 * sum(k.fwd_seconds for k in kids),
        )

    blocks = []
    for i in range(n_blocks):
        p = f"h.{i}"
        attn = [
            leaf(f"{p}.attn.{n}", s, t, m)
            for n, s, t, m in [
                ("q", 4, 1e-3, True),
                ("k", 4, 1e-3, True),
                ("v", 4, 1e-3, True),
                ("rope", 8, 2e-4, False),
                ("scores", 16, 2e-3, True),
                ("softmax", 16, 5e-4, False),
                ("drop", 8, 2e-4, False),
                ("ctx", 4, 2e-3, True),
                ("proj", 4, 1e-3, True),
                ("resid_drop", 1, 1e-4, False),
            ]
        ]
        mlp = [
            leaf(f"{p}.mlp.{n}", s, t, m)
            for n, s, t, m in [
                ("fc", 4, 4e-3, True),
                ("act", 16, 5e-4, False),
                ("out", 16, 4e-3, True),
                ("drop", 1, 1e-4, False),
            ]
        ]
        blocks.append(
            group(
                p,
                [
                    leaf(f"{p}.ln_1", 4, 2e-4),
                    group(f"{p}.attn", attn),
                    leaf(f"{p}.ln_2", 4, 2e-4),
                    group(f"{p}.mlp", mlp),
                ],
            )
        )
    kids = [leaf("wte", 4, 1e-4), *blocks, leaf("ln_f", 4, 2e-4), leaf("head", 48, 1e-2, True)]
    return UnitCost("", children=kids, sequential=sequential)


def flat_chain(n: int, sequential: bool, seed: int | None = None) -> UnitCost:
    rng = random.Random(seed)

    def jitter() -> float:
        return rng.uniform(0.5, 2.0) if seed is not None else 1.0

    kids = []
    for i in range(n):
        size = 2**20 * jitter()
        kids.append(
            UnitCost(
                f"layers.{i}",
                own_saved_bytes=3 * size,
                input_bytes=size,
                fwd_seconds=1e-3 * jitter(),
                fwd_flops=1e9,
            )
        )
    return UnitCost("", children=kids, sequential=sequential)
