"""What a profiled step measured of each unit (:class:`Stats`), and the clock it reads.

The :class:`~memfit.checkpoint.profiler.recorder.Recorder` fills one :class:`Stats` per
unit; :mod:`~memfit.checkpoint.profiler.build` turns them into the solver's costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Stats", "clock"]


def clock(sync: bool) -> float:
    """``time.perf_counter()`` after the device's queued work when ``sync`` (CUDA); else the
    CPU time of the calling thread (``time.thread_time()``), which runs the step's forward
    and, on a CPU, its backward too.

    A CPU step's wall time counts whatever else the machine ran meanwhile: on a 2-core CPU
    with two other busy processes, one unit's time moved by a third between profiles, and
    plans for one budget with it. The thread's CPU time leaves out the time it waited for
    a core; on a quiet machine the two agree."""
    if sync:
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.thread_time()


@dataclass
class Stats:
    """What a step measured of one unit.

    ``*_own``: of the unit's own ops, outside its child units; the rest covers its whole
    subtree. FLOPs, op times and the tail are of the forward. Times are in seconds, sizes
    in bytes. The instrumented step fills every field; a timed step only the forward,
    backward and measured tail times.
    """

    call_count: int = 0  # how many times the step called the unit
    first_call_order: int = -1  # its place among the units by first call (-1: never called)
    forward_seconds: float = 0.0  # wall time of its forward calls, children included
    backward_own_seconds: float = 0.0  # wall time of the autograd nodes its own ops made
    # Per op, max(FLOPs / flop rate, bytes moved / bandwidth), summed: the times used on
    # fake tensors, where nothing runs to be timed.
    estimated_forward_own_seconds: float = 0.0
    estimated_backward_own_seconds: float = 0.0
    forward_flops_own: float = 0.0
    non_matmul_flops_own: float = 0.0  # of forward_flops_own, outside MATMUL_OPS
    # Op times (measured op by op, or estimated on fake tensors) in and outside MATMUL_OPS:
    # their ratio splits the forward into what selective recompute keeps and re-runs.
    matmul_op_own_seconds: float = 0.0
    non_matmul_op_own_seconds: float = 0.0
    saved_bytes_own: int = 0  # saved for backward by its own ops (each storage once)
    matmul_output_bytes_own: int = 0  # outputs of its own matmul ops (what selective keeps)
    # The tail: the ops after the last tensor saved for backward, which a rebuild that
    # stops early skips. Its FLOPs and op time from the instrumented step, and its wall time
    # as the timed steps measured it (last saved tensor to the unit's end; CPU only).
    tail_flops: float = 0.0
    tail_op_seconds: float = 0.0
    tail_measured_seconds: float = 0.0
    # What selective checkpoint's caching dispatch mode adds to the unit's forward.
    selective_overhead_seconds: float = 0.0
    input_bytes: int = 0  # non-resident storages it received, over all calls
    output_bytes: int = 0  # non-resident storages it returned, over all calls
    # The most alive while the unit's subtree ran backward: what its subtree saved that
    # backward had not reached yet (by forward order), and what backward had made and still
    # held (the gradient passed in, parameter gradients, the backward's own temporaries).
    backward_peak_bytes: int = 0
    # The same, less the parameter gradients autograd had accumulated by each moment: what
    # a loop that releases each gradient in backward holds there, but for the update.
    backward_peak_released_bytes: int = 0
    # For each parameter whose gradient was accumulated while the subtree ran backward (by
    # name): what was alive then, less every accumulated gradient, its own included. Such
    # a loop updates it there, holding its gradient and its update's temporaries on top.
    release_levels: dict[str, int] = field(default_factory=dict)
    # How many parameter gradients (the first of Recorder.grad_order) backward had begun when
    # it first reached the subtree: those a rebuild of it holds (-1: never reached).
    grads_before_backward: int = -1
    # What backward held then (bwd_live): those gradients, and every activation gradient in
    # flight (a decoder block's, of its outputs and of the encoder's output it reads).
    backward_held_at_reach: int = 0
    # Of saved_bytes_own, what was saved after its last child unit began.
    saved_bytes_after_children: int = 0
    # The most its forward held at once, of what the step's forward ops made, above all the
    # step had saved for backward by the unit's end (measured steps only; the largest over
    # its calls): its inputs and outputs that nothing saves, its temporaries, what its
    # callers hold meanwhile (a list of earlier outputs).
    forward_peak_bytes: int = 0
    # Of what forward_peak_bytes counts (its call with the highest peak), the units' inputs
    # alive all through the call that nothing saved, by id (those of input_storage_ids):
    # a plan that keeps one as a checkpoint's input counts it there already.
    forward_unsaved_inputs: dict[int, int] = field(default_factory=dict)
    # Bytes of each non-resident storage it received, by storage key: to find the inputs
    # a sibling before it already saves.
    input_storage_bytes: dict[Any, int] = field(default_factory=dict)
    # The same storages by an id unique within the step (a key may be reused by a storage
    # allocated after the first one was freed; an id is not): to find the inputs that
    # units far apart receive alike (a position bias, an encoder's output).
    input_storage_ids: dict[int, int] = field(default_factory=dict)
    # Of saved_bytes_own, autocast's low-precision copies of weights, by the weight's
    # storage key: a rebuild makes them as it saves them (not besides).
    saved_casts_own: dict[Any, int] = field(default_factory=dict)
    # Why it cannot be recomputed (empty: it can).
    not_recomputable_reasons: list[str] = field(default_factory=list)
    # Why selective recompute would fail here (a matmul output it caches is changed in
    # place), or "" when it would not.
    not_selective_reason: str = ""

    def rule_out_recompute(self, why: str) -> None:
        """Record ``why`` the unit cannot be recomputed (each reason once)."""
        if why not in self.not_recomputable_reasons:
            self.not_recomputable_reasons.append(why)
