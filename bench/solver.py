"""How fast the optimal solver plans large trees: the timing the unit tests leave out.

Times ``solve(root, "optimal", budget)`` on six trees of about a thousand units and more (a
GPT-like tree of 48 blocks x 19 units, plain and sequential; sequential chains of 1,000
equal and irregular layers; a plain chain of 1,000 irregular layers; a GPT-like tree of
1,000 blocks x 19 units), at budgets of 40% and 70% of the unplanned peak, and prints the
median of ``--rounds`` solves each, for two solves:

* **plan**: the solve ``plan()`` makes with a budget: the planner's reserve kept, frontier
  included, and the cheaper plan within the reserve (``edge=True``) that a measured step
  may accept;
* **re-plan**: the solve the Engine's closed loop makes when the first planned step
  measured more than predicted: the same tree and budget, the step memory corrected up by
  2% of the unplanned peak, without the frontier (the edge still looked for).

docs/planner.md quotes it.

    python bench/solver.py --rounds 5
    python bench/solver.py --rounds 5 --only "1000 blocks"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from memfit.checkpoint.planner import RESERVE  # noqa: E402
from memfit.checkpoint.solvers import solve  # noqa: E402

from cost_trees import flat_chain, gpt_like  # noqa: E402

TREES = {
    "48 blocks x 19 units": lambda: gpt_like(48),
    "48 blocks x 19 units, sequential": lambda: gpt_like(48, sequential=True),
    "sequential chain of 1000 equal layers": lambda: flat_chain(1000, True),
    "sequential chain of 1000 irregular layers": lambda: flat_chain(1000, True, seed=1),
    "plain chain of 1000 irregular layers": lambda: flat_chain(1000, False, seed=2),
    "1000 blocks x 19 units": lambda: gpt_like(1000),
}

#: The re-plan's correction of the step memory, as a share of the unplanned peak.
CORRECTION = 0.02


def _timed(solve_once: Callable[[], object], rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        solve_once()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="solves per tree, budget and kind")
    parser.add_argument(
        "--only", default="", help="time only the trees whose name contains this text"
    )
    args = parser.parse_args()
    head = f"{'tree':<44} {'units':>5} {'budget':>6} {'plan':>9} {'range':>13}"
    print(f"{head} {'re-plan':>9} {'range':>13}")
    for name, make in TREES.items():
        if args.only not in name:
            continue
        root = make()
        units = sum(1 for _ in root.walk())
        none_peak = solve(root, "none", None).predicted_peak_bytes
        for share in (0.4, 0.7):
            budget = share * none_peak
            planner = {"reserve": RESERVE, "edge": True}
            plan = _timed(partial(solve, root, "optimal", budget, **planner), args.rounds)
            corrected = CORRECTION * none_peak
            replan = _timed(
                partial(solve, root, "optimal", budget, corrected, frontier=False, **planner),
                args.rounds,
            )
            cells = [
                f"{statistics.median(t):>7.2f} s {min(t):>5.2f}-{max(t):.2f} s"
                for t in (plan, replan)
            ]
            print(f"{name:<44} {units:>5} {share:>6.0%} {cells[0]} {cells[1]}")


if __name__ == "__main__":
    main()
