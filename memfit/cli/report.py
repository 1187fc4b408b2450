"""``memfit report RUN_DIR``: figures and a self-contained HTML page for a run directory.

Prints the path of ``report.html``. The figures are also written as PNG files next to it.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="plot a run directory's metrics into a self-contained HTML report",
        description="Write figures (loss, loss scale, gradient norm, memory, throughput, "
        "checkpoint plan) and a health table for a run directory, as PNG files and one "
        "self-contained report.html. Prints the HTML file's path.",
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
    from memfit.monitor.report import make_report

    path = make_report(args.run_dir, getattr(args, "out", None))
    print(path)
    return 0
