"""The planner's input: a tree of candidate units with their measured costs.

Plain dataclasses with no torch in them, so the solvers (the ``solvers`` package) can serve
any framework's recompute primitive. The profiler (``profiler/``) fills them in from a
profiled step.

Cost model (docs/planner.md has the full statement and its assumptions), per option:

* ``keep``      - kept: the unit's own saved bytes + what its children keep.
* ``recompute`` - checkpoint the whole unit: kept = its input bytes; extra time = the
                  subtree's forward time less its tail (below), + ``piece_seconds``.
* ``selective`` - checkpoint, but save the outputs of matmul-like ops: kept = input bytes +
                  matmul saved bytes; extra time = ``non_matmul_fwd_seconds`` +
                  ``piece_seconds``.
* segment i..j  - for ``sequential`` units: children i..j (j > i) as one piece: kept = child
                  i's input bytes; extra time = the sum of their forward times less child
                  j's tail, + child j's ``piece_seconds``.

``piece_seconds`` is what the checkpoint machinery itself takes, forward and backward
(saving and replaying RNG and autocast state, the saved-tensor hooks, starting the
rebuild), once for every call of the piece in a step.

A rebuild stops once every tensor the piece saves is back (torch's ``early_stop``): the
*tail*, the ops after the last one that saves a tensor (often a block's last projection
and residual add), is not run again.

Backward rebuilds one piece at a time, after everything after it in forward order has been
freed: a rebuild holds what is kept before the piece, its input and the input's gradient,
all the piece saves, ``recompute_extra_bytes`` and ``grads_from_bytes``, and what its
forward holds besides until its last save (``rebuild_forward_bytes``). Predicted peak =
static + max(kept + loss bytes at the end of forward, the highest rebuild).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, get_args

Decision = Literal["keep", "recompute", "selective"]
"""What a plan does with one unit: keep what it saves, recompute it whole in backward, or
recompute it but save the outputs of its matmul-like ops (selective)."""
KEEP: Decision = "keep"
RECOMPUTE: Decision = "recompute"
SELECTIVE: Decision = "selective"
#: Every decision, in that order (the one place the vocabulary is spelt).
DECISIONS: tuple[Decision, ...] = get_args(Decision)

Storage = Literal["keep", "bf16", "int8", "fp8", "offload"]
"""How a kept unit holds its saved tensors between forward and backward
(:mod:`memfit.checkpoint.storage`)."""
STORAGES: tuple[Storage, ...] = get_args(Storage)
#: The storages that code what a unit saves (all but keep), least lossy first.
CODINGS: tuple[Storage, ...] = tuple(k for k in STORAGES if k != "keep")


@dataclass
class UnitCost:
    """Costs of one candidate unit (a module), measured under the training precision."""

    name: str
    """Qualified module name (``""`` for the root)."""
    children: list[UnitCost] = field(default_factory=list)
    """Candidate sub-units, in forward order."""
    fwd_flops: float = 0.0
    """FLOPs of one forward of the whole subtree."""
    fwd_seconds: float = 0.0
    """Time of one forward of the whole subtree."""
    bwd_seconds: float = 0.0
    """Time of the backward of the whole subtree."""
    own_saved_bytes: float = 0.0
    """Bytes saved for backward by ops of this unit that lie in no child unit (deduplicated)."""
    own_saved_after_children_bytes: float = 0.0
    """Of those, the bytes its ops saved after its last child unit began (an LM's head and
    loss after its blocks): backward frees them before it reaches any child, so no child's
    rebuild holds them."""
    input_bytes: float = 0.0
    """Bytes of the tensors the unit receives; a checkpoint keeps them."""
    output_bytes: float = 0.0
    """Bytes of the tensors the unit returns."""
    matmul_saved_bytes: float = 0.0
    """Bytes of the whole subtree's saved tensors that are outputs of matmul-like ops."""
    non_matmul_fwd_flops: float = 0.0
    """Forward FLOPs of the subtree's ops that selective recompute re-runs."""
    non_matmul_fwd_seconds: float = 0.0
    """Time charged to a selective recompute of the subtree: the forward time of the ops it
    re-runs, plus what the selective machinery adds to the forward and to the rebuild
    (the profiler times it)."""
    can_recompute: bool = True
    """False when re-running the unit is unsafe (side effects, non-determinism) or impossible."""
    can_select: bool = True
    """False when selective recompute would fail: a matmul output made in the unit is changed
    in place later (e.g. ``ReLU(inplace=True)`` after a ``Linear``), and the cached copy
    would no longer be what the rebuild needs."""
    sequential: bool = False
    """True when memfit controls the iteration over the children (segments allowed)."""
    input_saved_by_previous_bytes: float = 0.0
    """Bytes of this unit's inputs that the sibling before it saves for backward (for a
    first child: its parent's own ops). When this unit is recomputed and that sibling (or
    parent) kept, the checkpoint keeps nothing new for them."""
    recompute_extra_bytes: float = 0.0
    """Bytes a rebuild of this unit allocates beyond what it saves and its input's gradient,
    for the whole subtree (e.g. autocast's 16-bit copies of its weights, cast again)."""
    saved_cast_bytes: float = 0.0
    """Of the subtree's saved bytes, autocast's 16-bit copies of its own weights (a
    matmul under autocast saves the copy of the weight it multiplies by): a rebuild makes
    them as it saves them, so they are no extra beside what it saves."""
    grads_from_bytes: float = 0.0
    """Gradients that exist when backward rebuilds this unit beyond the one in flight the
    static bytes count: the parameter gradients backward had made when it first reached
    the unit in the profiled step (``grads_before_backward``) or, if more, all it held then
    less that one (``backward_held_at_reach``: the gradients of a decoder block's other
    outputs too); where that was not measured, those of the unit and of everything after
    it in forward order and of its ancestors' own parameters (a bound)."""
    grads_before_backward: int = -1
    """How many of the profiled step's parameter gradients
    (:attr:`~memfit.checkpoint.profiler.Profile.grad_order`) existed when backward first
    reached the unit: its own are not among them unless a later use made them (a tied
    weight). -1: not measured, or the unit ran more than once (its earlier calls' rebuilds
    follow its own gradients)."""
    backward_held_at_reach: float = 0.0
    """What backward held when it first reached the unit in the profiled step, measured:
    the parameter gradients made by then and every activation gradient in flight (a T5
    decoder block's: its outputs', the position bias's it passes on, the encoder output's
    that the blocks after it added to). 0: not measured."""
    backward_peak_bytes: float = 0.0
    """The most alive while the subtree ran backward, measured: what it saved that backward
    had not reached yet, and what backward had made and still held (the gradient passed
    in, the parameter gradients made by then, its own temporaries: a wide layer's input
    gradient, attention scores' gradients)."""
    backward_peak_released_bytes: float = 0.0
    """``backward_peak_bytes`` for a loop that releases each gradient in backward: the most
    alive at any moment of the subtree's backward less the parameter gradients accumulated
    by then (measured; 0 where not)."""
    release_levels: dict[str, float] = field(default_factory=dict)
    """For each parameter whose gradient was accumulated during the subtree's backward (by
    name): what was alive at that moment less every accumulated gradient, its own too. A
    loop that releases gradients updates it there, with its gradient and its update's
    temporaries on top (measured; empty where not)."""
    backward_hold_bytes: float = 0.0
    """What the subtree's backward holds beyond all it saves, above the step's static
    bytes: ``backward_peak_bytes`` less the saved bytes and less what the static bytes
    count already (the gradient in flight; with accumulation, the gradients). A rebuild
    holds at least this above its input and what it rebuilds; a kept unit without children
    this above what is kept through it. Set by the planner."""
    forward_peak_bytes: float = 0.0
    """The most its forward held at once beyond all the step had saved for backward by the
    unit's end, measured on the unplanned step (0 where not measured: fake tensors): its
    inputs and outputs that nothing saves, its temporaries, and what its callers hold
    meanwhile (a list of earlier blocks' outputs that a concatenation reads later)."""
    forward_unsaved_inputs: tuple[tuple[int, float], ...] = ()
    """Of what ``forward_peak_bytes`` counts, units' inputs that were alive all through the
    unit's forward and that nothing saved (a concatenation's output that the model's
    callers hold while a block after it runs), each as ``(id, bytes)`` with the ids of
    :attr:`input_storages`. A plan that keeps one as an earlier checkpoint's input counts it
    there, so the unit's forward moment does not count it again (a recommender's
    concatenated features, 2.25 MiB, were counted twice: its least peak predicted 4.7%
    over)."""
    forward_hold_bytes: float = 0.0
    """What a kept unit's forward holds above what is kept through it, above the step's
    static bytes: ``forward_peak_bytes`` less what the held bytes count already (the
    gradient in flight between units, which forward has none of yet). Set by the planner;
    a kept leaf's moment is the larger of this and ``backward_hold_bytes``."""
    forward_workspace_bytes: float = 0.0
    """The most one op of the unit's forward holds for itself beyond every tensor (an
    LSTM layer's scratch), measured by the allocator on a rerun: a rebuild holds it on
    top of what it has rebuilt."""
    rebuild_forward_bytes: float = 0.0
    """The most a rebuild's forward holds above all it allocates and saves, up to its last
    op that saves a tensor (where a rebuild that stops early stops): outputs no op saves
    that a later op reads (a layer's output beside its LayerNorm's saved input), and the
    kernels' scratch then. Measured by the allocator on a rerun of the unit
    (:attr:`memfit.checkpoint.probe.ProbeResult.rebuild_forward`; 0 where not)."""
    backward_workspace_bytes: float = 0.0
    """How far the ops of the unit's backward raised its peak with what they hold for
    themselves beyond every tensor (a convolution's unfolded input, an attention kernel's
    fp32 accumulators), measured by the allocator on the rerun's backward
    (:attr:`memfit.allocator.AllocatorPeak.peak_op_workspace_bytes`): the dispatch-level
    ``backward_hold_bytes`` does not see it, so a rebuild's backward holds it on top. A
    scratch at a moment below the peak does not count."""
    tail_flops: float = 0.0
    """Forward FLOPs of the subtree's trailing ops, those after the last op that saves a
    tensor for backward: a rebuild that stops early (torch's ``early_stop``) skips them."""
    tail_seconds: float = 0.0
    """Forward time of those trailing ops."""
    input_storages: tuple[tuple[int, float], ...] = ()
    """The memory blocks behind the unit's inputs, each as ``(id, bytes)`` with an id
    unique within the profiled step (empty when not profiled). Units far apart may
    receive the same block (a position bias every layer adds, an encoder's output every
    cross-attention reads): pieces that keep it as their checkpoints' input hold it once,
    which the prediction counts (:func:`memfit.checkpoint.solvers.plan_cost`)."""
    input_saved_bytes: float = 0.0
    """Bytes of the unit's inputs that its own subtree saves for backward (a LayerNorm or a
    Linear at its start saves the tensor it receives). A rebuild of the unit saves them
    again without allocating: the checkpoint holds the input already."""
    input_saved_by_both_bytes: float = 0.0
    """Of those, the bytes this unit saves too. When the sibling before is recomputed and
    this unit kept, they stay held although the sibling's saved bytes counted them."""

    piece_seconds: float = 0.0
    """What the checkpoint machinery costs, per step, a piece that ends with this unit, over
    the rebuild's own ops: forward and backward bookkeeping (RNG and autocast state,
    saved-tensor hooks, starting and stopping the rebuild), once per call of the unit (a
    module called three times in a step is checkpointed three times). The profiler times
    the cost of one piece on the device (:attr:`Profile.piece_seconds`)."""

    def rebuild_seconds(self) -> float:
        """Time a piece ending with this unit costs for it: its forward less its tail, plus
        the checkpoint machinery's ``piece_seconds``.

        Example::

            UnitCost("b", fwd_seconds=8e-3, tail_seconds=1e-3, piece_seconds=1e-4).rebuild_seconds()
            # 0.0071
        """
        return max(0.0, self.fwd_seconds - self.tail_seconds) + self.piece_seconds

    def selective_seconds(self) -> float:
        """Time a selective recompute of this unit costs: the ops it re-runs, plus the
        checkpoint machinery's ``piece_seconds``."""
        return self.non_matmul_fwd_seconds + self.piece_seconds

    def rebuild_flops(self) -> float:
        """FLOPs of a rebuild of this unit as a piece of its own."""
        return max(0.0, self.fwd_flops - self.tail_flops)

    def total_saved_bytes(self) -> float:
        """Bytes the whole subtree saves for backward when nothing is recomputed."""
        return self.own_saved_bytes + sum(c.total_saved_bytes() for c in self.children)

    def walk(self) -> Iterator[UnitCost]:
        """This unit and every unit below it, parents before children."""
        yield self
        for child in self.children:
            yield from child.walk()


#: The nominal speeds of :func:`counted_times` (FLOP/s, bytes/s).
COUNTED_FLOP_RATE = 1e11
COUNTED_BANDWIDTH = 1e10


def counted_times(
    root: UnitCost,
    flop_rate: float = COUNTED_FLOP_RATE,
    bandwidth: float = COUNTED_BANDWIDTH,
    piece_seconds: float = 1e-4,
) -> UnitCost:
    """``root`` with every time replaced by one counted from FLOPs and bytes: a unit's
    forward takes ``fwd_flops / flop_rate`` plus the bytes it saves and returns over
    ``bandwidth``; its backward twice its forward; its tail and its selective share their
    FLOPs over ``flop_rate``; each piece ``piece_seconds``.

    Plans made from it depend on the model alone, not on how fast the machine ran the
    profile: the same on every machine and in every run (tests, reproducible plans).

    Example::

        >>> counted_times(UnitCost("", fwd_flops=2e11)).fwd_seconds
        2.0
    """

    def count(unit: UnitCost) -> UnitCost:
        children = [count(c) for c in unit.children]
        moved = unit.total_saved_bytes() + unit.output_bytes
        forward = unit.fwd_flops / flop_rate + moved / bandwidth
        return dataclasses.replace(
            unit,
            children=children,
            fwd_seconds=forward,
            bwd_seconds=2 * forward,
            tail_seconds=min(forward, unit.tail_flops / flop_rate),
            non_matmul_fwd_seconds=unit.non_matmul_fwd_flops / flop_rate,
            piece_seconds=piece_seconds,
        )

    return count(root)
