"""``memfit report RUN_DIR``: figures and a self-contained HTML page for a run directory.

Prints the path of ``report.html`` (the only line on stdout, for scripts). The figures are
also written as PNG files next to it. The run's advice (:func:`memfit.tuning.run_advice`) goes to
stderr, and into the page.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="plot a run directory's metrics into a self-contained HTML report",
        description="Write figures (loss, loss scale, gradient norm, memory, throughput, "
        "checkpoint plan), a health table and tuning advice for a run directory, as PNG "
        "files and one self-contained report.html. Prints the HTML file's path (and the "
        "advice on stderr).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where to write the report (default: RUN_DIR/report)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memfit.monitor import render_advice
    from memfit.monitor.report import make_report
    from memfit.tuning import run_advice

    advice = run_advice(args.run_dir)  # a run directory that cannot be read fails here
    # Printed before the figures are drawn: without matplotlib the advice still shows.
    print("advice:", file=sys.stderr)
    print(render_advice(advice), file=sys.stderr)
    path = make_report(args.run_dir, getattr(args, "out", None))
    print(path)
    return 0
