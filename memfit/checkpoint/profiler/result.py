"""What :func:`memfit.checkpoint.profiler.profile` returns: :class:`Profile`, the planner's
cost tree and the step's totals."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.checkpoint.costs import UnitCost
from memfit.units import format_bytes

__all__ = ["Profile"]


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
    sparse_grad_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of each sparse gradient the step made (indices and values), by parameter
    name: an ``nn.Embedding(sparse=True)``'s gradient holds one row per id looked up, not
    the table. Dense gradients are sized from their parameters and are absent."""
    retained_bytes: dict[str, int] = field(default_factory=dict)
    """What units' forward made and something other than autograd still held when the
    forward and the loss were done (a custom Function's ``ctx.x``, a Python list of
    hidden states), by unit: held under every plan, since a checkpointed forward keeps
    them all the same (:mod:`memfit.checkpoint.profiler.retained`). Measured steps only."""
    end_unsaved_inputs: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """Per unit, in the order their forwards ended (the last call's): units' inputs alive
    then that nothing saved, each as ``(id, bytes)`` with the ids of
    :attr:`UnitCost.input_storages` (a concatenation's output that the model holds until
    it returns). The loss's part of forward begins with the last unit's held
    (:attr:`memfit.checkpoint.workspace.StepEdges.loss_spike_bytes` counts them), and a
    plan that keeps one as a checkpoint's input counts it there too. Measured steps only."""
    grad_order: tuple[str, ...] = ()
    """The trained parameters' names in the order backward made the first part of each one's
    gradient (a weight used twice has one from its later use on, in autograd's buffer until
    the earlier use's part is added): the first :attr:`UnitCost.grads_before_backward` of
    them exist when backward reaches a unit. Instrumented steps only."""
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
