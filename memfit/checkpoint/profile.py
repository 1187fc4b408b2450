"""Cost profiling: one measured training step → a tree of :class:`UnitCost` for the planner.

:func:`profile` runs the model's forward and backward under the training precision
(``precision.autocast(device.type)``) and records, per candidate unit
(:mod:`memfit.checkpoint.tree`), what the cost model (:mod:`memfit.checkpoint.costs`) needs.

How each number is measured:

* **Bytes saved for backward**: ``torch.autograd.graph.saved_tensors_hooks`` sees every
  tensor autograd keeps. Each storage is counted once, for the innermost unit running when
  it was first saved. Storages of parameters, buffers and the example inputs are
  *resident* (they exist whatever the plan) and are not counted. Tensors saved by the loss
  (outside the model) go to :attr:`Profile.loss_saved_bytes`.
* **Input / output bytes**: the storages of the tensors a unit receives (positional and
  keyword) and returns, resident ones excluded, counted once per call.
* **Matmul saved bytes**: the outputs of matmul-like ops (:data:`~memfit.checkpoint.
  recompute.MATMUL_OPS`, seen by a ``TorchDispatchMode``). Selective recompute keeps *every* such
  output of the unit, whether or not autograd saves it, so that is what is counted.
* **FLOPs**: ``torch.utils.flop_counter``'s formulas (matmuls, convolutions, attention),
  plus :data:`FLOP_FORMULAS` for CPU attention kernels torch does not count. Elementwise
  ops count 0 FLOPs, as in ``FlopCounterMode``; :func:`flop_counter` counts the same way.
* **Tail** (what a rebuild that stops early skips): the FLOPs and op time of the unit's ops
  after the last one whose tensors autograd saves (saved-tensor hooks mark the point; every
  saved tensor counts, parameters too, as torch's ``early_stop`` counts them). Its time is
  measured in the timed step, from the last saved tensor to the unit's end (on CUDA, where
  that would need a device sync per saved tensor, and on fake tensors: the tail ops' share
  of the unit's op time, applied to its forward time).
* **Times**: forward time from forward pre/post hooks with ``time.perf_counter`` (the
  device synchronized on CUDA), in uninstrumented steps after the first (which warms up):
  each unit's time is its median over ``timed_steps`` steps (3 by default).
  Backward time per unit: a pre-hook on every autograd node stamps the time; each node's
  time (until the next node starts) goes to the unit that created it, found from the
  node's sequence number. This works whatever the unit returns, takes or modifies in place.
* **Checkpoint machinery per piece** (:attr:`Profile.piece_seconds`): a chain of tiny ops
  timed as pieces of memfit's executor and as plain ops, on the device and under the
  training precision; the median difference per piece (0 on fake tensors). Each unit is
  charged it once per call in the step (``UnitCost.piece_seconds``).
* **Non-matmul forward time** (what selective recompute re-runs): the unit's forward time
  times the share of its ops' time spent outside matmul-like ops, the ops timed one by one
  in the instrumented step. Measured op by op, the share is exact for the kernels, and the
  Python overhead of the unit is split in the same proportion (an estimate). Plus, twice
  (the forward and the rebuild), what selective checkpoint's dispatch mode adds to the
  unit's forward: whole-model forwards under that mode against plain ones, alternating,
  ``timed_steps`` of each, the median difference per unit (0 on fake tensors).
* **can_recompute** is False, with the reasons in :attr:`Profile.reasons`, when a unit
  modifies an input in place, updates a buffer in forward other than a normalization
  layer's running statistics (the executor handles those), or draws random numbers from an
  explicit ``torch.Generator`` (checkpoint only replays the default generators). Also for
  a container with no forward of its own (an ``nn.ModuleList``) and for units the step
  never called.
* **can_select** is False, with the reason in :attr:`Profile.no_selective`, when a matmul
  output made in the unit is changed in place later in the step (``ReLU(inplace=True)``
  right after a ``Linear`` or a convolution): selective recompute caches that output and
  torch refuses the changed copy in backward. Plain recompute is still offered.
* **sequential** is True for a chain (``nn.Sequential`` with the stock forward, or a
  container its parent iterates with ``for block in container``) whose children were
  called in index order, each with one tensor (no keyword arguments) that was the previous
  child's output, each returning one tensor.

On the **meta device** the model is run on fake tensors (``FakeTensorMode``; parameters,
buffers and inputs are swapped for fakes during the call): bytes and FLOPs are exact,
times are estimated per op as ``max(flops / flop_rate, bytes / bandwidth)``. A model whose
tensors are already fake is run under its own fake mode the same way.

Profiling leaves the model as it found it: parameters, buffers (BatchNorm statistics),
``.grad`` (None included), train/eval modes, an applied plan, and the RNG state.

Example::

    prof = profile(model, torch.randint(0, 256, (8, 128)), precision="bf16-mixed")
    print(prof.summary())
    prof.root            # UnitCost tree for memfit.checkpoint.solve
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
import weakref
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from memfit.checkpoint.apply import suspended
from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.recompute import (
    MATMUL_OPS,
    has_own_forward,
    run_checkpointed,
    stock_sequential,
)
from memfit.checkpoint.tree import (
    Unit,
    UnitTree,
    find_units,
    iter_override_class,
    structure_fingerprint,
    unit_tree,
)
from memfit.errors import ConfigError, PlanError
from memfit.nested import call_model, first_floating, map_tensors, tensors
from memfit.precision.policy import PrecisionPolicy
from memfit.units import format_bytes

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_FLOP_RATE",
    "FLOP_FORMULAS",
    "Profile",
    "flop_counter",
    "profile",
]

log = logging.getLogger(__name__)

#: Nominal FLOP rate (FLOP/s) for time estimates on fake tensors: a modern accelerator's
#: sustained dense 16-bit matmul rate. Pass your device's to :func:`profile`.
DEFAULT_FLOP_RATE = 100e12
#: Nominal memory bandwidth (bytes/s) for time estimates on fake tensors.
DEFAULT_BANDWIDTH = 2e12


def _sdpa_cpu_flops(
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flops(
    grad_out_shape: Any,
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    formulas: dict[Any, Callable[..., int]] = {}
    for name, fn in (
        ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu_flops),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_cpu_backward_flops),
    ):
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            continue
        if packet not in flop_registry:
            formulas[packet] = fn
    return formulas


#: FLOP formulas (shape functions, as ``FlopCounterMode(custom_mapping=...)`` takes them)
#: for ops torch's counter misses: CPU fused attention. Used by :func:`profile`.
FLOP_FORMULAS: dict[Any, Callable[..., int]] = _extra_formulas()

_FLOPS: dict[Any, Callable[..., int]] = {
    **flop_registry,
    **{k: shape_wrapper(v) for k, v in FLOP_FORMULAS.items()},
}


def flop_counter(display: bool = False) -> FlopCounterMode:
    """A ``FlopCounterMode`` that counts FLOPs as :func:`profile` does.

    Example::

        with flop_counter() as fc:
            loss_fn(model(x)).backward()
        fc.get_total_flops()
    """
    return FlopCounterMode(display=display, custom_mapping=FLOP_FORMULAS)


@dataclass
class Profile:
    """What one profiled training step measured: the planner's cost tree and step totals.

    Example::

        prof = profile(model, x)
        prof.root.children[0].fwd_flops
        prof["blocks.0"].total_saved_bytes()
        prof.param_bytes + prof.grad_bytes + prof.activation_bytes
    """

    root: UnitCost
    """The cost tree, rooted at the model (name ``""``)."""
    structure: list[tuple[str, str]]
    """``structure_fingerprint`` of the profiled units, for plans to recognize the model."""
    precision: str
    """The precision mode the step ran under."""
    device: str
    """The device the step ran on (for fake tensors, the device they stood in for)."""
    measured: bool
    """True when times were measured; False when estimated from FLOPs and bytes (fake/meta)."""
    param_bytes: int
    """Bytes of the parameters (each shared parameter once)."""
    grad_bytes: int
    """Bytes of the gradients the backward produced."""
    buffer_bytes: int
    """Bytes of the buffers."""
    activation_bytes: int
    """Bytes saved for backward by the model with no checkpointing (sum over units)."""
    loss_saved_bytes: int
    """Bytes saved for backward by the loss, outside the model (checkpointing keeps them)."""
    input_bytes: int
    """Bytes of the example inputs."""
    output_bytes: int
    """Bytes of the model's output."""
    fwd_flops: float
    """Forward FLOPs of the model."""
    fwd_seconds: float
    """Forward time of the model (loss excluded)."""
    bwd_seconds: float
    """Backward time of the whole step."""
    flop_rate: float
    """The FLOP rate used for time estimates."""
    bandwidth: float
    """The memory bandwidth used for time estimates."""
    reasons: dict[str, list[str]] = field(default_factory=dict)
    """Why a unit cannot be recomputed, per unit name (units that can are absent)."""
    no_selective: dict[str, str] = field(default_factory=dict)
    """Why a unit cannot be recomputed selectively, per unit name (units that can are
    absent; their ``can_select`` is False)."""
    head_backward_bytes: int = 0
    """The most that the head of backward (the loss's ops and the top units' own ops, before
    backward reaches any unit below them) holds at once of what it makes: the gradients of
    the logits and of the loss's intermediates, the LM head's weight gradient. Everything
    kept is still alive then, so it adds to the end of forward's peak."""
    piece_seconds: float = 0.0
    """What the checkpoint machinery costs one piece on this device, forward and backward,
    over the ops it recomputes (0 when times are estimated). Each unit carries it times
    its calls in the step as :attr:`UnitCost.piece_seconds`."""

    def __post_init__(self) -> None:
        self._units = {u.name: u for u in self.root.walk()}

    def __getitem__(self, name: str) -> UnitCost:
        return self._units[name]

    def __contains__(self, name: object) -> bool:
        return name in self._units

    def units(self) -> dict[str, UnitCost]:
        """Every unit's costs by qualified name, parents before children."""
        return dict(self._units)

    def summary(self) -> str:
        """A human-readable table of the units' costs."""
        head = (
            f"{'unit':<32} {'GFLOP':>8} {'fwd ms':>8} {'bwd ms':>8} {'saved':>11} "
            f"{'input':>11} {'matmul':>11}  flags"
        )
        rows = [head, "-" * len(head)]

        def row(u: UnitCost, depth: int) -> None:
            flags = [] if u.can_recompute else ["no-recompute"]
            if u.can_recompute and not u.can_select:
                flags.append("no-selective")
            if u.sequential:
                flags.append("sequential")
            name = ("  " * depth + (u.name or "<model>"))[:32]
            rows.append(
                f"{name:<32} {u.fwd_flops / 1e9:>8.3f} {u.fwd_seconds * 1e3:>8.2f} "
                f"{u.bwd_seconds * 1e3:>8.2f} {format_bytes(u.total_saved_bytes()):>11} "
                f"{format_bytes(u.input_bytes):>11} {format_bytes(u.matmul_saved_bytes):>11}"
                f"  {' '.join(flags)}"
            )
            for c in u.children:
                row(c, depth + 1)

        row(self.root, 0)
        timing = "measured" if self.measured else "estimated"
        rows.append(
            f"precision {self.precision} on {self.device}; times {timing}; params "
            f"{format_bytes(self.param_bytes)}, grads {format_bytes(self.grad_bytes)}, "
            f"activations {format_bytes(self.activation_bytes)} "
            f"(+ loss {format_bytes(self.loss_saved_bytes)}); checkpoint machinery "
            f"{self.piece_seconds * 1e6:.0f} us a piece"
        )
        return "\n".join(rows)


# --------------------------------------------------------------------------- helpers


def _storage(t: torch.Tensor) -> tuple[Any, int, Any]:
    """(key, bytes, keep-alive reference) of the memory behind ``t``."""
    try:
        st = t.untyped_storage()
        return st._cdata, int(st.nbytes()), st
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        # Tensors without a plain storage (sparse, some subclasses): count the tensor itself.
        return ("tensor", id(t)), t.numel() * t.element_size(), t


def _clock(sync: bool) -> float:
    """``time.perf_counter()``, after the device's queued work when ``sync`` (CUDA)."""
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter()


def _default_loss(output: Any) -> torch.Tensor:
    t = first_floating(output)
    if t is None:
        raise PlanError("the model's output holds no floating-point tensor; pass loss_fn")
    if not t.requires_grad:
        raise PlanError(
            "the first floating-point tensor of the model's output does not require "
            "grad, so the default loss cannot backpropagate; pass loss_fn"
        )
    return t.float().sum()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _probe_iter(self: nn.Module) -> Iterator[nn.Module]:
    marks = self.__dict__.get("_memfit_iterated")
    if marks is not None:
        marks.append(True)
    return iter(self._modules.values())


# --------------------------------------------------------------------------- recording


@dataclass
class _Stats:
    calls: int = 0
    first_call: int = -1
    fwd_time: float = 0.0
    bwd_time_own: float = 0.0
    est_fwd_own: float = 0.0
    est_bwd_own: float = 0.0
    flops_own: float = 0.0
    nm_flops_own: float = 0.0
    mm_time_own: float = 0.0
    nm_time_own: float = 0.0
    saved_own: int = 0
    mm_out_own: int = 0
    tail_flops: float = 0.0
    tail_time: float = 0.0
    tail_timed: float = 0.0  # the tail's time as the timed step measured it (CPU)
    sel_overhead: float = 0.0  # what selective checkpoint's caching mode adds to its forward
    input_bytes: int = 0
    output_bytes: int = 0
    input_keys: dict[Any, int] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    # Why selective recompute would fail here (a matmul output it caches is changed in place).
    no_selective: str = ""

    def reason(self, text: str) -> None:
        if text not in self.reasons:
            self.reasons.append(text)


@dataclass
class _Call:
    name: str
    t0: float = 0.0
    # FLOPs and op time since the last tensor saved for backward inside this call: the
    # tail a rebuild that stops early skips.
    tail_flops: float = 0.0
    tail_time: float = 0.0
    last_pack: float | None = None  # in the timed step: when it last saved a tensor
    in_versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    buf_versions: list[tuple[str, nn.Module, str, torch.Tensor, int]] = field(default_factory=list)


@dataclass
class _ChainState:
    n: int
    expected: int = 0
    passes: int = 0
    ok: bool = True
    last_out: torch.Tensor | None = None


class _Recorder:
    """Hooks, a dispatch mode and saved-tensor hooks for one profiled step."""

    def __init__(
        self,
        tree: UnitTree,
        stats: dict[str, _Stats],
        *,
        full: bool,
        measured: bool,
        sync: bool,
        flop_rate: float,
        bandwidth: float,
    ) -> None:
        self.tree = tree
        self.stats = stats
        self.full = full  # the instrumented step (bytes, FLOPs, ops) or the timed one
        self.measured = measured
        self.sync = sync
        self.flop_rate = flop_rate
        self.bandwidth = bandwidth
        self.unit_of: dict[int, str] = {id(u.module): u.name for u in tree}
        self.parent_of: dict[str, tuple[str, int]] = {}
        self.chains: dict[str, _ChainState] = {}
        for unit in tree:
            if unit.is_chain:
                self.chains[unit.name] = _ChainState(len(unit.children))
                for k, child in enumerate(unit.children):
                    self.parent_of[child.name] = (unit.name, k)
        self.stack: list[_Call] = []
        self.phase: str | None = None
        self.bwd_owner: str | None = None
        self.quiet = False
        self.markers: list[int] = []
        self.owners: list[str | None] = []
        self.probe: torch.Tensor | None = None
        self.bwd_events: list[tuple[float, str | None]] = []
        self.resident: set[Any] = set()
        self.saved_seen: dict[Any, Any] = {}
        self.saved_by: dict[Any, set[str | None]] = {}  # every unit that saves a storage
        self.saved_owner: dict[Any, str | None] = {}
        self.mm_seen: dict[Any, Any] = {}
        self.mm_units: dict[Any, tuple[str, ...]] = {}  # the units around each matmul output
        # The head of backward: the loss's and the top units' own ops, before backward
        # reaches any unit below them. What it makes, live at once, at most.
        self.top = _top_chain(tree.root)
        self.in_head = True
        self.head_keys: set[Any] = set()
        self.head_live = [0]
        self.head_peak = 0
        self.loss_saved = 0
        self.counter = 0
        self.iterated: dict[str, list[bool]] = {}
        self.subtree_buffers: dict[str, list[tuple[nn.Module, str]]] = {}
        if full:
            for unit in tree:
                self.subtree_buffers[unit.name] = [
                    (m, name)
                    for m in unit.module.modules()
                    if not isinstance(m, nn.modules.batchnorm._NormBase)
                    for name in m._buffers
                ]

    # ---- time and sequence numbers

    def now(self) -> float:
        return _clock(self.sync)

    def mark(self, owner: str | None) -> None:
        # The sequence number of a fresh autograd node: every node created after this
        # point belongs to ``owner`` until the next mark.
        self.quiet = True
        try:
            with torch.enable_grad():
                assert self.probe is not None
                node = self.probe.view_as(self.probe).grad_fn
        finally:
            self.quiet = False
        # No node under inference mode: nothing there goes to backward anyway.
        seq = node._sequence_nr() if node is not None else (self.markers or [0])[-1]
        self.markers.append(seq)
        self.owners.append(owner)

    def owner(self, seq: int) -> str | None:
        i = bisect_right(self.markers, seq) - 1
        return self.owners[i] if i >= 0 else None

    # ---- module hooks

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = self.unit_of.get(id(module))
        if name is None or self.phase != "fwd":
            return
        st = self.stats[name]
        call = _Call(name)
        if self.full:
            st.calls += 1
            if st.first_call < 0:
                st.first_call = self.counter
            self.counter += 1
            received = tensors((args, kwargs))
            call.in_versions = [(t, t._version) for t in received]
            st.input_bytes += self.nonresident_bytes(received)
            for t in received:
                key, nbytes, _ = _storage(t)
                if key not in self.resident:
                    st.input_keys[key] = nbytes
            call.buf_versions = [
                (bname, m, bname, buf, buf._version)
                for m, bname in self.subtree_buffers[name]
                if (buf := m._buffers.get(bname)) is not None
            ]
            self.chain_enter(name, args, kwargs)
        self.stack.append(call)
        self.mark(name)
        call.t0 = self.now()

    def post_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        name = self.unit_of.get(id(module))
        if name is None or self.phase != "fwd" or not self.stack or self.stack[-1].name != name:
            return
        t1 = self.now()
        call = self.stack.pop()
        st = self.stats[name]
        st.fwd_time += t1 - call.t0
        self.mark(self.stack[-1].name if self.stack else None)
        if not self.full:
            st.tail_timed += t1 - (call.last_pack if call.last_pack is not None else call.t0)
            return
        if any(t._version != v for t, v in call.in_versions):
            st.reason("modifies an input tensor in place, so a recompute would see changed inputs")
        for label, m, bname, buf, version in call.buf_versions:
            if m._buffers.get(bname) is not buf or buf._version != version:
                st.reason(
                    f"updates buffer {type(m).__name__}.{label} in forward, so a recompute "
                    "would see the updated value"
                )
        st.output_bytes += self.nonresident_bytes(tensors(output))
        st.tail_flops += call.tail_flops
        st.tail_time += call.tail_time
        self.chain_exit(name, output)

    def chain_enter(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        where = self.parent_of.get(name)
        if where is None:
            return
        state = self.chains[where[0]]
        k = where[1]
        single = args[0] if len(args) == 1 and not kwargs else None
        if not isinstance(single, torch.Tensor) or k != state.expected:
            state.ok = False
        elif k > 0 and single is not state.last_out:
            state.ok = False

    def chain_exit(self, name: str, output: Any) -> None:
        where = self.parent_of.get(name)
        if where is None:
            return
        state = self.chains[where[0]]
        k = where[1]
        if not isinstance(output, torch.Tensor):
            state.ok = False
        state.last_out = output if isinstance(output, torch.Tensor) else None
        state.expected = (k + 1) % state.n
        if k == state.n - 1:
            state.passes += 1

    # ---- bytes

    def nonresident_bytes(self, items: list[torch.Tensor]) -> int:
        seen: set[Any] = set()
        total = 0
        for t in items:
            key, nbytes, _ = _storage(t)
            if key in self.resident or key in seen:
                continue
            seen.add(key)
            total += nbytes
        return total

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.phase not in ("fwd", "loss"):
            return t
        # A rebuild that stops early stops here if nothing is saved after this (resident
        # tensors count: checkpoint counts every saved tensor).
        for call in self.stack:
            call.tail_flops = call.tail_time = 0.0
        key, nbytes, ref = _storage(t)
        if key in self.resident:
            return t
        self.saved_by.setdefault(key, set()).add(self.stack[-1].name if self.stack else None)
        if key in self.saved_seen:
            return t
        self.saved_seen[key] = ref  # held so that a freed storage's address is not reused
        self.saved_owner[key] = self.stack[-1].name if self.stack else None
        if self.stack:
            self.stats[self.stack[-1].name].saved_own += nbytes
        else:
            self.loss_saved += nbytes
        return t

    def pack_time(self, t: torch.Tensor) -> torch.Tensor:
        if self.phase == "fwd":
            now = time.perf_counter()
            for call in self.stack:
                call.last_pack = now
        return t

    # ---- ops

    def on_op(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, seconds: float) -> None:
        if self.phase in ("fwd", "loss") and self.mm_units and func._schema.is_mutable:
            self.check_mutation(func, args, kwargs)
        if self.phase == "bwd" and self.in_head:
            self.head_made(out)
        if self.phase == "fwd":
            unit = self.stack[-1].name if self.stack else None
        elif self.phase == "bwd":
            unit = self.bwd_owner
        else:
            unit = None
        if unit is None:
            return
        packet = func.overloadpacket
        formula = _FLOPS.get(packet)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        moved = sum(t.numel() * t.element_size() for t in tensors((args, kwargs, out)))
        estimate = max(flops / self.flop_rate, moved / self.bandwidth)
        st = self.stats[unit]
        if self.phase == "bwd":
            st.est_bwd_own += estimate
            return
        st.flops_own += flops
        st.est_fwd_own += estimate
        op_time = seconds if self.measured else estimate
        for call in self.stack:
            call.tail_flops += flops
            call.tail_time += op_time
        if packet in MATMUL_OPS:
            st.mm_time_own += op_time
            for t in tensors(out):
                key, nbytes, ref = _storage(t)
                if key not in self.mm_seen and key not in self.resident:
                    self.mm_seen[key] = ref
                    self.mm_units[key] = tuple(call.name for call in self.stack)
                    st.mm_out_own += nbytes
        else:
            st.nm_time_own += op_time
            st.nm_flops_own += flops
        if kwargs.get("generator") is not None:
            for call in self.stack:
                self.stats[call.name].reason(
                    f"draws random numbers from an explicit torch.Generator ({packet}), "
                    "which checkpoint does not replay"
                )

    def check_mutation(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """Selective recompute caches matmul outputs and refuses, in backward, one that
        was changed in place after it was made (``ReLU(inplace=True)`` right after a
        ``Linear`` or a convolution): every unit around such an output cannot be selective."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tensors(value):
                for name in self.mm_units.get(_storage(t)[0], ()):
                    st = self.stats[name]
                    st.no_selective = st.no_selective or (
                        f"a matmul output made in it is changed in place later "
                        f"({func.overloadpacket}), which selective recompute cannot replay"
                    )

    def head_made(self, out: Any) -> None:
        """Count the new tensors an op of the head of backward makes (gradients, among them
        the top modules' weight gradients) while they live, and keep their peak."""
        for t in tensors(out):
            key, nbytes, ref = _storage(t)
            if key in self.head_keys or key in self.saved_seen or key in self.resident:
                continue  # a view of a gradient counted already, or a forward tensor
            try:
                weakref.finalize(ref, _head_freed, self.head_keys, self.head_live, key, nbytes)
            except TypeError:
                continue  # nothing to follow the lifetime of: not counted
            self.head_keys.add(key)
            self.head_live[0] += nbytes
        self.head_peak = max(self.head_peak, self.head_live[0])

    # ---- backward

    def hook_graph(self, roots: list[Any]) -> list[Any]:
        handles = []
        seen: set[int] = set()
        keep: list[Any] = []
        todo = [r for r in roots if r is not None]
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            keep.append(node)
            seq = node._sequence_nr()
            if seq < 2**62:  # AccumulateGrad nodes carry UINT64_MAX
                handles.append(node.register_prehook(self._node_hook(self.owner(seq))))
            todo.extend(n for n, _ in node.next_functions if n is not None)
        return handles

    def _node_hook(self, owner: str | None) -> Callable[[Any], None]:
        def hook(grad_outputs: Any) -> None:
            if self.full:
                self.bwd_owner = owner
                if owner is not None and owner not in self.top:
                    self.in_head = False
            else:
                self.bwd_events.append((self.now(), owner))

        return hook


def _head_freed(keys: set[Any], live: list[int], key: Any, nbytes: int) -> None:
    keys.discard(key)
    live[0] -= nbytes


def _top_chain(root: Unit) -> set[str]:
    """The root and its single-child descendants: units around every other unit (a step
    module around the model), whose own ops run at the head of backward."""
    names = {root.name}
    while len(root.children) == 1:
        root = root.children[0]
        names.add(root.name)
    return names


class _OpMode(TorchDispatchMode):
    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        rec = self.rec
        if rec.quiet or rec.phase is None:
            return func(*args, **kwargs)
        t0 = rec.now() if rec.measured else 0.0
        out = func(*args, **kwargs)
        seconds = rec.now() - t0 if rec.measured else 0.0
        rec.on_op(func, args, kwargs, out, seconds)
        return out


# --------------------------------------------------------------------------- the step


def _run_step(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    policy: PrecisionPolicy,
    device_type: str,
    rec: _Recorder,
    tree: UnitTree,
    *,
    forward_only: bool = False,
    wrap: Callable[[Callable[[], Any]], Any] | None = None,
) -> tuple[Any, float]:
    """One forward + backward with ``rec`` attached; returns (output, backward seconds).
    ``forward_only``: stop after the model's forward (backward seconds 0); ``wrap``: runs
    the model's forward, given as a function of no arguments (as a checkpointed piece)."""
    handles = []
    swapped: list[tuple[nn.Module, type]] = []
    try:
        for unit in tree:
            m = unit.module
            handles.append(m.register_forward_pre_hook(rec.pre_hook, with_kwargs=True))
            handles.append(
                m.register_forward_hook(rec.post_hook, with_kwargs=True, always_call=True)
            )
            if rec.full and unit.is_chain and not stock_sequential(m):
                rec.iterated[unit.name] = []
                m.__dict__["_memfit_iterated"] = rec.iterated[unit.name]
                swapped.append((m, type(m)))
                m.__class__ = iter_override_class(type(m), _probe_iter)
        rec.probe = torch.zeros((), requires_grad=True)
        modes = contextlib.ExitStack()
        with modes:
            if rec.full:
                modes.enter_context(_OpMode(rec))
                modes.enter_context(torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t))
            elif not rec.sync:
                # Where the last saved tensor of each unit comes, timed: its tail is the rest.
                modes.enter_context(
                    torch.autograd.graph.saved_tensors_hooks(rec.pack_time, lambda t: t)
                )
            rec.phase = "fwd"
            with policy.autocast(device_type):
                run = functools.partial(call_model, model, inputs)
                output = run() if wrap is None else wrap(run)
                if forward_only:
                    return output, 0.0
                rec.phase = "loss"
                loss = loss_fn(output)
            if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
                raise PlanError(
                    "the loss does not depend on the model's parameters through autograd "
                    "(no grad_fn); pass a loss_fn that returns a differentiable scalar"
                )
            handles.extend(rec.hook_graph([loss.grad_fn]))
            rec.phase = "bwd"
            t0 = rec.now()
            loss.backward()
            t1 = rec.now()
            rec.phase = None
        if not rec.full:
            events = rec.bwd_events + [(t1, None)]
            for (t, owner), (t_next, _) in zip(events, events[1:]):
                if owner is not None:
                    rec.stats[owner].bwd_time_own += t_next - t
        return output, t1 - t0
    finally:
        rec.phase = None
        for h in handles:
            h.remove()
        for m, cls in swapped:
            m.__class__ = cls
            m.__dict__.pop("_memfit_iterated", None)


@contextlib.contextmanager
def _preserved(model: nn.Module, train: bool | None, rng_devices: list[int]) -> Iterator[None]:
    """Leave the model's modes, buffers, grads, plan and the RNG as they were."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [
        (m, name, buf, buf.detach().clone())
        for m in model.modules()
        for name, buf in m._buffers.items()
        if buf is not None
    ]
    params = list(model.parameters())
    grads = [p.grad for p in params]
    with suspended(model):
        try:
            for p in params:
                p.grad = None
            if train:
                model.train()
            with torch.random.fork_rng(devices=rng_devices, device_type="cuda"):
                yield
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            with torch.no_grad():
                for m, name, buf, value in buffers:
                    m._buffers[name] = buf
                    buf.copy_(value)
            for m, mode in modes:
                m.training = mode


@contextlib.contextmanager
def _fake_run(
    model: nn.Module, inputs: Any, fake_device: str | None
) -> Iterator[tuple[Any, Any, torch.device]]:
    """Yield (inputs, fake mode or None, device) to run the step with.

    Meta tensors cannot autocast or hold values; they are swapped for fake tensors on a
    real device type for the duration of the step, and put back afterwards.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    every = [*model.parameters(), *model.buffers(), *tensors(inputs)]
    fake = next((t for t in every if _is_fake(t)), None)
    if fake is not None:
        with fake.fake_mode:
            yield inputs, fake.fake_mode, fake.device
        return
    if not any(t.device.type == "meta" for t in every):
        device = every[0].device if every else torch.device("cpu")
        yield inputs, None, device
        return

    dev = torch.device(fake_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            with mode:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)
            if isinstance(t, nn.Parameter):
                f = nn.Parameter(f, requires_grad=t.requires_grad)
            memo[id(t)] = f
        return memo[id(t)]

    originals: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for m in model.modules():
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if t is not None:
                        originals.append((table, name, t))
                        table[name] = to_fake(t)
        fake_inputs = map_tensors(inputs, to_fake)
        with mode:
            yield fake_inputs, mode, dev
    finally:
        for table, name, t in originals:
            table[name] = t


def _resolve_tree(
    model: nn.Module, units: UnitTree | Sequence[str] | None, extra: Sequence[str] | None
) -> UnitTree:
    if isinstance(units, UnitTree):
        return units
    if units is None:
        return find_units(model, extra)
    if isinstance(units, str):
        units = [units]
    return unit_tree(model, [*units, *(extra or [])])


def profile(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    precision: str | PrecisionPolicy | None = None,
    units: UnitTree | Sequence[str] | None = None,
    extra: Sequence[str] | None = None,
    train: bool | None = True,
    flop_rate: float = DEFAULT_FLOP_RATE,
    bandwidth: float = DEFAULT_BANDWIDTH,
    fake_device: str | None = None,
    timed_steps: int = 3,
) -> Profile:
    """Measure the per-unit costs of a training step of ``model`` on ``example_inputs``:
    one instrumented step, then ``timed_steps`` timed ones.

    Args:
        model: The model, as it will train (after ``precision.apply``; low-precision
            weights are fine). A plan applied to it is taken off for the step and put back.
        example_inputs: A tensor (``model(x)``), a tuple (``model(*args)``) or a dict
            (``model(**kwargs)``), of the batch size training will use.
        loss_fn: ``loss_fn(output) -> scalar``; default: the sum of the first floating-point
            tensor in the output.
        precision: The training precision (a mode string or policy; default fp32).
        units: The candidate units: None to find them (:func:`find_units`), a
            :class:`UnitTree`, or a list of qualified module names (exactly those units).
        extra: Module names to add to the found units.
        train: Put the model in train mode for the step (``None``: leave modes alone). The
            modes are restored afterwards either way.
        flop_rate, bandwidth: Device speed for time estimates on fake/meta tensors.
        fake_device: The device type fake tensors stand in for when the model is on the
            meta device (default: ``"cuda"`` when available, else ``"cpu"``).
        timed_steps: Steps timed after the instrumented one; each time is the median
            over them (default 3).

    Returns:
        A :class:`Profile`; ``profile.root`` is the planner's input.

    Raises:
        PlanError: When no units are found (the message says how to name them), for an
            unknown unit name, or when the loss cannot backpropagate.

    Example::

        prof = profile(model, batch[:, :-1], precision="bf16-mixed")
        prof["blocks.0"].fwd_flops, prof.activation_bytes
    """
    if isinstance(timed_steps, bool) or not isinstance(timed_steps, int) or timed_steps < 1:
        raise ConfigError(f"timed_steps must be a whole number >= 1, got {timed_steps!r}")
    policy = PrecisionPolicy.of(precision)
    tree = _resolve_tree(model, units, extra)
    loss_fn = loss_fn or _default_loss
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    first = next(iter([*model.parameters(), *tensors(example_inputs)]), None)
    rng_devices = (
        [first.device.index or 0]
        if first is not None and first.device.type == "cuda" and not _is_fake(first)
        else []
    )
    stats = {u.name: _Stats() for u in tree}
    with _preserved(model, train, rng_devices):
        with _fake_run(model, example_inputs, fake_device) as (inputs, fake_mode, device):
            measured = fake_mode is None
            settings: dict[str, Any] = dict(
                measured=measured,
                sync=measured and device.type == "cuda",
                flop_rate=flop_rate,
                bandwidth=bandwidth,
            )
            rec = _Recorder(tree, stats, full=True, **settings)
            rec.resident = {
                _storage(t)[0] for t in [*model.parameters(), *model.buffers(), *tensors(inputs)]
            }
            output, bwd_seconds = _run_step(model, inputs, loss_fn, policy, device.type, rec, tree)
            grad_bytes = _unique_bytes([p.grad for p in model.parameters() if p.grad is not None])
            input_bytes = _unique_bytes(tensors(inputs))
            output_bytes = rec.nonresident_bytes(tensors(output))
            loss_saved = rec.loss_saved
            head_backward = rec.head_peak
            iterated = {name: bool(marks) for name, marks in rec.iterated.items()}
            chains = rec.chains
            saved_owner = dict(rec.saved_owner)
            saved_by = dict(rec.saved_by)
            del output, rec  # frees the step's saved references before the timed step
            if measured:
                # The instrumented step above doubles as warm-up; these are only timed.
                timing = _Timing(model, inputs, loss_fn, policy, device.type, tree, settings)
                bwd_seconds = _timed_steps(timed_steps, timing, stats)
                if any(st.mm_out_own > 0 for st in stats.values()):
                    try:
                        _selective_overheads(timed_steps, timing, stats)
                    except Exception as exc:  # the option is lost, not the profile
                        why = f"selective recompute could not be timed: {type(exc).__name__}: {exc}"
                        log.warning("%s; plans will not use it", why)
                        for st in stats.values():
                            st.no_selective = st.no_selective or why
                piece_seconds = _piece_overhead(policy, device, settings["sync"])
            else:
                piece_seconds = 0.0
    # The timed steps timed each unit's tail unless they synchronize the device (CUDA),
    # where that would take a sync per saved tensor: the tail's time is then its ops' share.
    timed_tails = measured and not settings["sync"]
    root = _build(tree.root, stats, chains, iterated, measured, timed_tails)
    if measured:
        _pool_times(tree.root, root)
    for unit in root.walk():
        # A module called several times in a step is checkpointed on every call.
        unit.piece_seconds = piece_seconds * max(1, stats[unit.name].calls)
    _mark_shared_inputs(tree.root, root, stats, saved_owner, saved_by)
    return Profile(
        root=root,
        structure=structure_fingerprint(model, tree),
        precision=policy.mode,
        device=str(device),
        measured=measured,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        buffer_bytes=buffer_bytes,
        activation_bytes=int(root.total_saved_bytes()),
        loss_saved_bytes=loss_saved,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        fwd_flops=root.fwd_flops,
        fwd_seconds=root.fwd_seconds,
        bwd_seconds=bwd_seconds if measured else root.bwd_seconds,
        flop_rate=flop_rate,
        bandwidth=bandwidth,
        reasons={n: list(st.reasons) for n, st in stats.items() if st.reasons},
        no_selective={n: st.no_selective for n, st in stats.items() if st.no_selective},
        piece_seconds=piece_seconds,
        head_backward_bytes=head_backward,
    )


#: Pieces and rounds :func:`_piece_overhead` times: enough that a piece's cost (about
#: 0.1 ms on a CPU) stands well above the timer's resolution, yet a few tens of ms in all.
_OVERHEAD_PIECES = 24
_OVERHEAD_ROUNDS = 5


def _piece_overhead(policy: PrecisionPolicy, device: torch.device, sync: bool) -> float:
    """Seconds the executor's checkpoint adds per piece, forward and backward.

    A chain of tiny ops (each saves its input, so a rebuild runs) is timed with every op a
    piece of its own (:func:`~memfit.checkpoint.recompute.run_checkpointed`, as plans run
    them, under the training precision) and without; the median difference over a few
    interleaved rounds, per piece. What the rebuilt ops themselves take is in the difference too, but on eight
    numbers it is a few microseconds against the machinery's hundred or so."""
    x = torch.zeros(8, device=device, requires_grad=True)

    def step(pieces: bool) -> float:
        start = _clock(sync)
        with policy.autocast(device.type):
            y = x
            for _ in range(_OVERHEAD_PIECES):
                if pieces:
                    y = run_checkpointed(torch.sin, (y,), {}, [], selective=False, early_stop=True)
                else:
                    y = torch.sin(y)
        y.sum().backward()
        return _clock(sync) - start

    def difference(r: int) -> float:
        # Alternate which runs first, so that neither always follows the other.
        if r % 2:
            plain = step(False)
            return step(True) - plain
        return step(True) - step(False)

    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        difference(0)  # warm-up
        diffs = [difference(r) for r in range(_OVERHEAD_ROUNDS)]
    return max(0.0, statistics.median(diffs) / _OVERHEAD_PIECES)


@dataclass
class _Timing:
    """The step the timed passes of a profile run, and how they are timed."""

    model: nn.Module
    inputs: Any
    loss_fn: Callable[[Any], torch.Tensor]
    policy: PrecisionPolicy
    device_type: str
    tree: UnitTree
    settings: dict[str, Any]

    def run(self, **step: Any) -> tuple[dict[str, _Stats], float]:
        """One uninstrumented pass (``step``: :func:`_run_step`'s keywords): each unit's
        times in fresh stats, by name, and the backward seconds."""
        stats = {u.name: _Stats() for u in self.tree}
        timer = _Recorder(self.tree, stats, full=False, **self.settings)
        _, bwd = _run_step(
            self.model, self.inputs, self.loss_fn, self.policy, self.device_type, timer,
            self.tree, **step,
        )  # fmt: skip
        return stats, bwd


def _timed_steps(steps: int, timing: _Timing, stats: dict[str, _Stats]) -> float:
    """Time ``steps`` uninstrumented steps; leave each unit's median forward, backward and
    tail time in ``stats`` and return the median backward time of the step. One step's
    times move with whatever else the machine does (30% between two runs on a busy 2-core
    CPU); the median of a few steps is what plans should not flip on."""
    timed = ("fwd_time", "bwd_time_own", "tail_timed")
    passes: list[dict[str, _Stats]] = []
    bwd: list[float] = []
    for _ in range(steps):
        for p in timing.model.parameters():
            p.grad = None
        times, seconds = timing.run()
        passes.append(times)
        bwd.append(seconds)
    for name, st in stats.items():
        for attr in timed:
            setattr(st, attr, statistics.median(getattr(p[name], attr) for p in passes))
    return statistics.median(bwd)


def _selective_overheads(rounds: int, timing: _Timing, stats: dict[str, _Stats]) -> None:
    """Leave in each unit's stats what selective checkpoint's machinery adds to its forward.

    Selective checkpoint runs a piece's forward, and again its rebuild, under a Python
    dispatch mode that asks a policy about every op and caches what it must save. On a CPU
    that costs more than the non-matmul ops it re-runs (a block of the benchmark GPT: its
    forward 2.8 ms longer, on 9 ms), and it grows with the tensors, so it is timed rather
    than assumed: the whole model's forward as one selective piece of memfit's executor
    against the same as a plain piece (neither saves activations), alternating, the median
    difference per unit. Every op pays it, so one forward prices every unit at once. The
    first selective forward of a process sets torch up (about a second on a CPU): it runs
    once untimed."""
    # The inputs go in as arguments only so that checkpoint finds their device.
    args = tuple(tensors(timing.inputs))
    model = timing.model

    def forward(selective: bool) -> dict[str, _Stats]:
        def wrap(run: Callable[[], Any]) -> Any:
            return run_checkpointed(
                lambda *_: run(), args, {}, [model], selective=selective, early_stop=True
            )

        return timing.run(forward_only=True, wrap=wrap)[0]

    forward(True)  # warm-up
    passes: dict[bool, list[dict[str, _Stats]]] = {False: [], True: []}
    for r in range(rounds):
        for selective in (False, True) if r % 2 == 0 else (True, False):
            passes[selective].append(forward(selective))
    for name, st in stats.items():
        plain, cached = (
            statistics.median(p[name].fwd_time for p in passes[kind]) for kind in (False, True)
        )
        st.sel_overhead = max(0.0, cached - plain)


def _unique_bytes(items: list[torch.Tensor]) -> int:
    return sum({key: nbytes for key, nbytes, _ in map(_storage, items)}.values())


def _pool_times(unit: Unit, cost: UnitCost) -> None:
    """Give units that do the same work the median of their measured times.

    Units of one class with the same FLOPs, saved, input and output bytes and tail, and
    children alike (the blocks of a transformer, the residual blocks of a ResNet stage), run
    the same kernels on the same shapes; one step's timings of them differ only by noise
    (a millisecond in ten on a busy CPU), which would make the planner prefer one block over
    its twin for nothing."""
    classes = {u.name: u.class_name for u in unit.walk()}
    groups: dict[tuple, list[UnitCost]] = {}

    def signature(c: UnitCost) -> tuple:
        key = (
            classes[c.name],
            c.fwd_flops,
            c.own_saved_bytes,
            c.input_bytes,
            c.output_bytes,
            c.tail_flops,
            c.matmul_saved_bytes,
            c.can_recompute,
            tuple(signature(k) for k in c.children),
        )
        groups.setdefault(key, []).append(c)
        return key

    signature(cost)
    for members in groups.values():
        if len(members) < 2:
            continue
        fwd = statistics.median(m.fwd_seconds for m in members)
        bwd = statistics.median(m.bwd_seconds for m in members)

        # The parts of the forward (tail, selective) get the median of their shares of it.
        tail, selective = (
            statistics.median(
                getattr(m, part) / m.fwd_seconds if m.fwd_seconds > 0 else 0.0 for m in members
            )
            for part in ("tail_seconds", "non_matmul_fwd_seconds")
        )
        for m in members:
            m.fwd_seconds, m.bwd_seconds = fwd, bwd
            m.tail_seconds, m.non_matmul_fwd_seconds = fwd * tail, fwd * selective


def _mark_shared_inputs(
    unit: Unit,
    cost: UnitCost,
    stats: dict[str, _Stats],
    saved_owner: dict[Any, str | None],
    saved_by: dict[Any, set[str | None]],
) -> None:
    """Set each unit's ``input_saved_by_previous_bytes``: bytes of its inputs that the
    sibling before it already saves for backward (e.g. a block whose last ReLU saves the
    output the next block receives), and ``input_saved_by_both_bytes``: those it saves too
    (a convolution saves its input; under autocast it saves a 16-bit copy instead)."""

    def inside(owner: str | None, name: str) -> bool:
        return owner is not None and (owner == name or owner.startswith(name + "."))

    by_name = {c.name: c for c in cost.children}
    units = {u.name: u for u in unit.children}
    for prev, cur in zip(cost.children, cost.children[1:]):
        shared = {
            key: n
            for key, n in stats[cur.name].input_keys.items()
            if inside(saved_owner.get(key), prev.name)
        }
        both = sum(
            n for key, n in shared.items() if any(inside(o, cur.name) for o in saved_by[key])
        )
        cur.input_saved_by_previous_bytes = float(sum(shared.values()))
        cur.input_saved_by_both_bytes = float(both)
    for name, child in by_name.items():
        _mark_shared_inputs(units[name], child, stats, saved_owner, saved_by)


def _build(
    unit: Unit,
    stats: dict[str, _Stats],
    chains: dict[str, _ChainState],
    iterated: dict[str, bool],
    measured: bool,
    timed_tails: bool,
) -> UnitCost:
    """The UnitCost subtree of ``unit`` from the recorded per-unit stats."""
    children = [_build(c, stats, chains, iterated, measured, timed_tails) for c in unit.children]
    if not unit.is_chain:
        # Forward order; units never called go last, in registration order.
        never = float("inf")
        children.sort(key=lambda c: stats[c.name].first_call if stats[c.name].calls else never)
    names = [u.name for u in unit.walk()]

    def total(attr: str) -> float:
        return float(sum(getattr(stats[n], attr) for n in names))

    st = stats[unit.name]
    module = unit.module
    if not has_own_forward(module):
        st.reason(
            f"{type(module).__name__} has no forward of its own; checkpoint its children "
            "or segments of them"
        )
    elif st.calls == 0:
        st.reason("was not called in the profiled step")
    fwd_seconds = st.fwd_time if measured else total("est_fwd_own")
    input_bytes, output_bytes = float(st.input_bytes), float(st.output_bytes)
    if st.calls == 0 and children:
        # A container its parent iterates is never called itself: its forward is its
        # children's, and (when they form a chain) its input is the first one's.
        fwd_seconds = sum(c.fwd_seconds for c in children) if measured else fwd_seconds
        if unit.is_chain:
            input_bytes, output_bytes = children[0].input_bytes, children[-1].output_bytes
    bwd_seconds = total("bwd_time_own") if measured else total("est_bwd_own")
    mm_time, nm_time = total("mm_time_own"), total("nm_time_own")
    share = nm_time / (mm_time + nm_time) if mm_time + nm_time > 0 else 0.0
    # Without a timed tail: its ops' share of the unit's op time, as for selective recompute.
    tail_share = min(1.0, st.tail_time / (mm_time + nm_time)) if mm_time + nm_time > 0 else 0.0
    chain = chains.get(unit.name)
    sequential = (
        unit.is_chain
        and chain is not None
        and chain.ok
        and chain.passes >= 1
        and chain.expected == 0
        and (stock_sequential(module) or iterated.get(unit.name, False))
    )
    return UnitCost(
        name=unit.name,
        children=children,
        fwd_flops=total("flops_own"),
        fwd_seconds=fwd_seconds,
        bwd_seconds=bwd_seconds,
        own_saved_bytes=float(st.saved_own),
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        matmul_saved_bytes=total("mm_out_own"),
        non_matmul_fwd_flops=total("nm_flops_own"),
        # The rebuild runs the same ops under the same kind of mode: it pays the overhead too.
        non_matmul_fwd_seconds=fwd_seconds * share + 2 * st.sel_overhead,
        tail_flops=min(st.tail_flops, total("flops_own")),
        tail_seconds=min(st.tail_timed, fwd_seconds) if timed_tails else fwd_seconds * tail_share,
        can_recompute=not st.reasons,
        can_select=not st.no_selective,
        sequential=bool(sequential),
    )
