"""What kind of CPU the tests run on, decided from its flags and the limits set on it,
never from timing."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512-BF16 or AMX, not limited to AVX2 by
    ``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA``)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return (
        torch.backends.cpu.get_cpu_capability() != "AVX2"
        and ("avx512_bf16" in flags or "amx_bf16" in flags)
        and os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() not in ("AVX2", "AVX", "SSE41")
    )
