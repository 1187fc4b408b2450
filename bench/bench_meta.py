"""What a benchmark's JSON records about the run: the machine, the versions, memfit's commit.

commit = memfit_commit()              # before the run: the library it imports
meta = run_meta(args, wall_seconds, commit, reserve=0.02)
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import transformers


def memfit_commit() -> str | None:
    """The repository's commit, "+dirty" when memfit/ differs from it (read only); None
    outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "memfit"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def run_meta(
    args: argparse.Namespace, wall_seconds: float, commit: str | None, **extra: Any
) -> dict[str, Any]:
    """The JSON's ``meta`` block: machine, versions, threads, commit, arguments, wall time,
    then ``extra``."""
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "memfit_commit": commit,
        "args": vars(args),
        "wall_seconds": wall_seconds,
        **extra,
    }
