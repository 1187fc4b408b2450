"""How fast the optimal solver plans large trees: the timing the unit tests leave out.

Times ``solve(root, "optimal", budget)`` on five trees of about a thousand units (a GPT-like
tree of 48 blocks x 19 units, plain and sequential; sequential chains of 1,000 equal and
irregular layers; a plain chain of 1,000 irregular layers), at budgets of 40% and 70% of the
unplanned peak, and prints the median of ``--rounds`` solves each. docs/planner.md quotes it.

    python bench/solver.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from memfit.checkpoint.solvers import solve  # noqa: E402

from cost_trees import flat_chain, gpt_like  # noqa: E402

TREES = {
    "48 blocks x 19 units": lambda: gpt_like(48),
    "48 blocks x 19 units, sequential": lambda: gpt_like(48, sequential=True),
    "sequential chain of 1000 equal layers": lambda: flat_chain(1000, True),
    "sequential chain of 1000 irregular layers": lambda: flat_chain(1000, True, seed=1),
    "plain chain of 1000 irregular layers": lambda: flat_chain(1000, False, seed=2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="solves per tree and budget")
    args = parser.parse_args()
    print(f"{'tree':<44} {'units':>5} {'budget':>6} {'median':>9} {'range':>17}")
    for name, make in TREES.items():
        root = make()
        units = sum(1 for _ in root.walk())
        none_peak = solve(root, "none", None).predicted_peak_bytes
        for share in (0.4, 0.7):
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                solve(root, "optimal", share * none_peak)
                times.append(time.perf_counter() - start)
            spread = f"{min(times):.2f}-{max(times):.2f} s"
            print(
                f"{name:<44} {units:>5} {share:>6.0%} {statistics.median(times):>7.2f} s "
                f"{spread:>17}"
            )


if __name__ == "__main__":
    main()
