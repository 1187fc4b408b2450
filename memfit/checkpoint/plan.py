"""``memfit.Plan``: which units to recompute, what that is predicted to cost, and for what.

A plan records the decision per unit, the segments of sequential units, the predicted peak
split into its parts, the recompute cost, the frontier it was picked from, the precision
its costs were measured under and a fingerprint of the model's structure, so that it
refuses to apply to a different model. It is plain data: JSON in, JSON out.

Example::

    plan = memfit.plan(model, x, budget="1GiB")
    print(plan.summary())
    text = plan.to_json()
    assert memfit.Plan.from_json(text) == plan
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.checkpoint.costs import CODINGS, DECISIONS, KEEP, RECOMPUTE, SELECTIVE, UnitCost
from memfit.checkpoint.solvers import FrontierPoint, Solution
from memfit.errors import PlanError
from memfit.units import format_bytes

__all__ = ["FORMAT", "VERSION", "Piece", "Plan", "structure_hash"]

#: The ``"format"`` tag of a plan's JSON.
FORMAT = "memfit-plan"
#: The JSON format version this memfit writes, and the newest it reads.
VERSION = 1

Structure = list[tuple[str, str]]


def structure_hash(structure: Sequence[Sequence[str]]) -> str:
    """The sha256 of a structure fingerprint, for plans that should not list the model.

    >>> structure_hash([("", "GPT"), ("blocks.0", "Block")])[:12]
    'e6d5e2db6880'
    """
    canonical = json.dumps([[str(n), str(c)] for n, c in structure], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Piece:
    """One recomputed piece of a plan and what it trades, for the summary.

    >>> Piece("blocks.3", "recompute", None, 96.0 * 2**20, 4.0 * 2**20, 0.0012, 2.5e9)
    Piece(unit='blocks.3', kind='recompute', children=None, saved_bytes=100663296.0, kept_bytes=4194304.0, recompute_seconds=0.0012, recompute_flops=2500000000.0)
    """

    unit: str
    """The unit recomputed, or the sequential unit whose children form the segment."""
    kind: str
    """``"recompute"``, ``"selective"`` or ``"segment"``."""
    children: tuple[int, int] | None
    """For a segment, its inclusive child index range; None otherwise."""
    saved_bytes: float
    """What the piece would save for backward if nothing in it were recomputed."""
    kept_bytes: float
    """What it keeps instead: its inputs (and, selective, the matmul outputs)."""
    recompute_seconds: float
    """Forward time spent rebuilding it in backward."""
    recompute_flops: float
    """Forward FLOPs spent rebuilding it in backward."""


@dataclass
class Plan:
    """A checkpoint plan for one model under one precision.

    Example::

        plan = memfit.plan(model, x, budget="512MiB", strategy="optimal")
        plan.decisions["blocks.3"]      # "recompute"
        plan.predicted_peak_bytes       # static + kept + transient
    """

    decisions: dict[str, str]
    """Unit qualified name → ``"keep"`` | ``"recompute"`` | ``"selective"``; every unit is
    listed, and units inside a recomputed piece say ``"keep"``."""
    segments: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Sequential unit → inclusive child index ranges, each checkpointed as one piece."""
    strategy: str = "optimal"
    """The strategy that made the plan (``"optimal"``, ``"uniform:4"``, ...)."""
    budget_bytes: float | None = None
    """The budget the plan was made for (the peak of a whole step), or None."""
    predicted_peak_bytes: float = 0.0
    """static + kept + transient as the planner predicts it (or, when higher, what the
    optimizer step holds: parameters, all gradients, optimizer state)."""
    static_bytes: float = 0.0
    """Bytes held all step that checkpointing cannot change: parameters, optimizer state,
    inputs, the activation gradient in flight."""
    kept_bytes: float = 0.0
    """Activation bytes held from forward to backward under the plan."""
    transient_bytes: float = 0.0
    """What the peak holds beyond static and kept: the loss at the end of forward, or, when
    higher, a piece being rebuilt in backward (what is kept after it is freed by then).
    Below 0 where the highest moment is the end of forward or a kept unit's forward, which
    hold no activation gradient in flight (counted in static for backward's moments)."""
    recompute_flops: float = 0.0
    """Extra forward FLOPs per step."""
    recompute_seconds: float = 0.0
    """Extra time per step (as profiled): rebuilds and the checkpoint machinery."""
    frontier: list[FrontierPoint] = field(default_factory=list)
    """The (peak, recompute) trade-offs the strategy could reach, by increasing peak."""
    precision: str = "fp32"
    """The precision mode the costs were measured under."""
    structure: Structure | str | None = None
    """The model the plan was made for: (unit name, module class) pairs, or their
    :func:`structure_hash`; None when unknown (then it is not checked)."""
    notes: list[str] = field(default_factory=list)
    """Plain remarks, e.g. that the budget needs no checkpointing."""
    exact: bool = True
    """False when the optimal solver fell back to approximate walks on a large tree (a
    cheaper plan may exist)."""
    pieces: list[Piece] = field(default_factory=list)
    """The recomputed pieces with what each trades, when the costs were given."""
    version: int = VERSION
    """The plan format version."""
    storage: dict[str, str] = field(default_factory=dict)
    """Kept units whose saved tensors are stored compressed or off the device: unit
    qualified name → ``"bf16"`` | ``"int8"`` | ``"fp8"`` | ``"offload"`` (each over its
    whole subtree, :mod:`memfit.checkpoint.storage`); empty: every kept unit keeps them as
    they are."""
    storage_seconds: float = 0.0
    """Extra time per step coding and decoding the stored units' tensors, in the terms of
    ``recompute_seconds`` (measured, or counted with counted costs)."""
    measured_peak_bytes: float | None = None
    """The step's peak under the plan as the allocator measured it on the example batch
    (one forward and backward over the step's static bytes) when the planner verified it;
    None when not measured (``verify=False``, or a plan made by hand)."""

    @classmethod
    def from_solution(
        cls,
        solution: Solution,
        *,
        precision: str,
        structure: Sequence[Sequence[str]] | str | None = None,
        units_info: UnitCost | None = None,
    ) -> Plan:
        """Wrap a solver :class:`~memfit.checkpoint.solvers.Solution`.

        ``units_info``: the cost tree the solution was made from; with it the plan lists
        what each recomputed piece saves and costs.

        >>> from memfit.checkpoint.solvers import solve
        >>> a, b = (UnitCost(n, own_saved_bytes=64.0, input_bytes=8.0) for n in "ab")
        >>> tree = UnitCost("", children=[a, b])
        >>> plan = Plan.from_solution(solve(tree, "full", None), precision="bf16-mixed",
        ...                           structure=[("", "Net"), ("a", "Linear")], units_info=tree)
        >>> plan.decisions, plan.pieces[0].saved_bytes
        ({'': 'keep', 'a': 'recompute', 'b': 'recompute'}, 64.0)
        """
        if isinstance(structure, str) or structure is None:
            fingerprint: Structure | str | None = structure
        else:
            fingerprint = [(str(n), str(c)) for n, c in structure]
        return cls(
            decisions=dict(solution.decisions),
            segments={k: [(int(a), int(b)) for a, b in v] for k, v in solution.segments.items()},
            strategy=solution.strategy,
            budget_bytes=solution.budget_bytes,
            predicted_peak_bytes=solution.predicted_peak_bytes,
            static_bytes=solution.static_bytes,
            kept_bytes=solution.kept_bytes,
            transient_bytes=solution.transient_bytes,
            recompute_flops=solution.recompute_flops,
            recompute_seconds=solution.recompute_seconds,
            frontier=list(solution.frontier),
            precision=precision,
            structure=fingerprint,
            notes=[solution.note] if solution.note else [],
            exact=solution.exact,
            pieces=_pieces(units_info, solution.decisions, solution.segments) if units_info else [],
        )

    # ------------------------------------------------------------------ structure

    def check_structure(self, fingerprint: Sequence[Sequence[str]] | str) -> None:
        """Raise :class:`PlanError` naming the first difference from the model's fingerprint.

        ``fingerprint`` is the model's (unit name, module class) list, or its
        :func:`structure_hash`. A plan without a structure accepts any model.

        >>> plan = Plan({}, structure=[("", "GPT"), ("h.0", "Block")])
        >>> plan.check_structure([("", "GPT"), ("h.0", "Block")])
        >>> plan.check_structure([("", "GPT"), ("h.0", "MLP")])
        Traceback (most recent call last):
        ...
        memfit.errors.PlanError: this plan was made for a different model: unit #1 is 'h.0' (Block) in the plan but 'h.0' (MLP) in this model. Make a new plan for this model (memfit.plan or `memfit plan`).
        """
        if self.structure is None:
            return
        if isinstance(fingerprint, str) or isinstance(self.structure, str):
            mine = (
                self.structure
                if isinstance(self.structure, str)
                else structure_hash(self.structure)
            )
            theirs = fingerprint if isinstance(fingerprint, str) else structure_hash(fingerprint)
            if mine != theirs:
                raise PlanError(
                    f"this plan was made for a different model: its structure hash is "
                    f"{mine[:16]}..., this model's is {theirs[:16]}... Make a new plan for this "
                    "model (memfit.plan or `memfit plan`)."
                )
            return
        mine_list = [(str(n), str(c)) for n, c in self.structure]
        theirs_list = [(str(n), str(c)) for n, c in fingerprint]
        for i, (a, b) in enumerate(zip(mine_list, theirs_list)):
            if a != b:
                raise PlanError(
                    f"this plan was made for a different model: unit #{i} is {a[0]!r} "
                    f"({a[1]}) in the plan but {b[0]!r} ({b[1]}) in this model. "
                    "Make a new plan for this model (memfit.plan or `memfit plan`)."
                )
        if len(mine_list) != len(theirs_list):
            longer = "plan" if len(mine_list) > len(theirs_list) else "model"
            n = min(len(mine_list), len(theirs_list))
            extra = (mine_list if longer == "plan" else theirs_list)[n]
            raise PlanError(
                f"this plan was made for a different model: the {longer} has more units, the "
                f"first extra one is {extra[0]!r} ({extra[1]}). Make a new plan for this model."
            )

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> str:
        """The plan as JSON text; :meth:`from_json` reads it back to an equal plan.

        >>> text = Plan({"": "keep"}, precision="bf16-mixed").to_json()
        >>> Plan.from_json(text) == Plan({"": "keep"}, precision="bf16-mixed")
        True
        """
        data: dict[str, Any] = {
            "format": FORMAT,
            "version": self.version,
            "strategy": self.strategy,
            "precision": self.precision,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "static_bytes": self.static_bytes,
            "kept_bytes": self.kept_bytes,
            "transient_bytes": self.transient_bytes,
            "recompute_flops": self.recompute_flops,
            "recompute_seconds": self.recompute_seconds,
            "exact": self.exact,
            "notes": list(self.notes),
            "decisions": dict(self.decisions),
            "storage": dict(self.storage),
            "storage_seconds": self.storage_seconds,
            "segments": {k: [[a, b] for a, b in v] for k, v in self.segments.items()},
            "structure": self.structure
            if self.structure is None or isinstance(self.structure, str)
            else [[n, c] for n, c in self.structure],
            "frontier": [
                [p.peak_bytes, p.recompute_seconds, p.recompute_flops] for p in self.frontier
            ],
            "pieces": [
                {
                    "unit": p.unit,
                    "kind": p.kind,
                    "children": None if p.children is None else list(p.children),
                    "saved_bytes": p.saved_bytes,
                    "kept_bytes": p.kept_bytes,
                    "recompute_seconds": p.recompute_seconds,
                    "recompute_flops": p.recompute_flops,
                }
                for p in self.pieces
            ],
        }
        try:
            # Python writes floats with repr, which reads back to the same float.
            return json.dumps(data, indent=1, allow_nan=False)
        except ValueError as exc:
            raise PlanError(f"cannot write the plan as JSON: {exc} (NaN or infinity)") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """Read a plan written by :meth:`to_json`.

        Raises :class:`PlanError` for text that is not JSON, JSON that is not a memfit
        plan, a plan from a newer memfit, or a plan with missing or ill-typed fields.

        >>> Plan.from_json('{"format": "something-else"}')
        Traceback (most recent call last):
        ...
        memfit.errors.PlanError: not a memfit plan: its "format" is 'something-else', expected "memfit-plan"; write plans with Plan.to_json() or `memfit plan --json`
        """
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as exc:
            raise PlanError(f"not a memfit plan: the text is not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PlanError(
                f'not a memfit plan: its "format" is {found!r}, expected "{FORMAT}"; write '
                "plans with Plan.to_json() or `memfit plan --json`"
            )
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise PlanError(f"malformed memfit plan: version {version!r} is not a positive integer")
        if version > VERSION:
            raise PlanError(
                f"this plan has format version {version}, written by a newer memfit; this memfit "
                f"reads versions up to {VERSION}. Upgrade memfit or make the plan again with it."
            )
        return _read(data, version)

    # ------------------------------------------------------------------ display

    def summary(self, max_rows: int = 24) -> str:
        """A readable table: the recomputed pieces, the predicted peak by part, the
        recompute cost, and the frontier with the chosen point marked.

        >>> print(Plan({"": "keep"}, predicted_peak_bytes=2**30, static_bytes=2**30).summary())
        checkpoint plan: strategy optimal, precision fp32, no budget
        <BLANKLINE>
          nothing is recomputed (1 unit keeps its activations)
        <BLANKLINE>
          predicted peak     1.00 GiB
            static           1.00 GiB  parameters, optimizer state, inputs
            kept                  0 B  activations held for backward
            transient             0 B  the loss, or the highest rebuild in backward
          recompute        0.00 GFLOP  0.00 ms per step
        """
        budget = (
            f"budget {format_bytes(self.budget_bytes)}"
            if self.budget_bytes is not None
            else "no budget"
        )
        lines = [
            f"checkpoint plan: strategy {self.strategy}, precision {self.precision}, {budget}",
            "",
        ]
        lines += self._piece_rows(max_rows)
        lines += self._storage_rows(max_rows)
        lines += [
            "",
            f"  predicted peak {format_bytes(self.predicted_peak_bytes):>12}",
            *self._measured_rows(),
            f"    static       {format_bytes(self.static_bytes):>12}  parameters, "
            "optimizer state, inputs",
            f"    kept         {format_bytes(self.kept_bytes):>12}  activations held for backward",
            f"    transient    {format_bytes(self.transient_bytes):>12}  "
            + (
                "the loss, or the highest rebuild in backward"
                if self.transient_bytes >= 0
                else "the highest moment has no gradient in flight, which static counts"
            ),
            f"  recompute      {f'{self.recompute_flops / 1e9:.2f} GFLOP':>12}  "
            f"{self.recompute_seconds * 1e3:.2f} ms per step",
        ]
        lines += self._frontier_rows()
        notes = list(self.notes)
        if not self.exact:
            notes.append(
                "the tree was too large to prove this plan optimal; a slightly cheaper one "
                "may exist"
            )
        if notes:
            lines.append("")
            lines += [f"  note: {n}" for n in notes]
        return "\n".join(line.rstrip() for line in lines)

    def _storage_rows(self, max_rows: int) -> list[str]:
        if not self.storage:
            return []
        by_kind: dict[str, list[str]] = {}
        for unit, kind in self.storage.items():
            by_kind.setdefault(kind, []).append(unit or "(model)")
        out = [""]
        for kind, units in by_kind.items():
            shown = ", ".join(units[:max_rows]) + (
                f" and {len(units) - max_rows} more" if len(units) > max_rows else ""
            )
            out.append(f"  stored {kind:<8} {shown}")
        out.append(f"  coding           {self.storage_seconds * 1e3:.2f} ms per step")
        return out

    def _measured_rows(self) -> list[str]:
        if self.measured_peak_bytes is None:
            return []
        predicted, measured = self.predicted_peak_bytes, self.measured_peak_bytes
        error = f" ({(measured - predicted) / predicted:+.1%})" if predicted else ""
        return [
            f"  measured peak  {format_bytes(measured):>12}  one step on the example "
            f"batch, by the allocator{error}"
        ]

    def _piece_rows(self, max_rows: int) -> list[str]:
        kept = sum(d == KEEP for d in self.decisions.values())
        rows: list[tuple[str, str, str, str]] = []
        if self.pieces:
            for p in self.pieces:
                name = _piece_name(p.unit, p.children)
                rows.append(
                    (
                        name,
                        p.kind,
                        format_bytes(p.saved_bytes - p.kept_bytes),
                        f"{p.recompute_seconds * 1e3:.2f} ms",
                    )
                )
        else:
            for unit, d in self.decisions.items():
                if d != KEEP:
                    rows.append((_piece_name(unit, None), d, "", ""))
            for unit, ranges in self.segments.items():
                rows.extend((_piece_name(unit, r), "segment", "", "") for r in ranges)
        if not rows:
            who = "1 unit keeps its" if kept == 1 else f"{kept} units keep their"
            return [f"  nothing is recomputed ({who} activations)"]
        width = max(4, *(len(r[0]) for r in rows))
        costs = bool(self.pieces)  # without the costs, only names and decisions
        head = f"  {'unit':<{width}}  {'decision':<10}"
        out = [head + (f" {'frees':>11} {'recompute':>11}" if costs else "")]
        for r in rows[:max_rows]:
            line = f"  {r[0]:<{width}}  {r[1]:<10}"
            out.append(line + (f" {r[2]:>11} {r[3]:>11}" if costs else ""))
        if len(rows) > max_rows:
            out.append(f"  ... and {len(rows) - max_rows} more pieces")
        out.append(f"  {kept} units say keep (those inside a recomputed piece included)")
        return out

    def _frontier_rows(self) -> list[str]:
        if not self.frontier:
            return []
        points = self.frontier
        chosen = _chosen(points, self.recompute_seconds, self.predicted_peak_bytes)
        shown = sorted(
            {round(i * (len(points) - 1) / 9) for i in range(10)} | {chosen}
            if len(points) > 10
            else set(range(len(points)))
        )
        count = "1 point" if len(points) == 1 else f"{len(points)} points"
        if len(shown) < len(points):  # say that the list is a sample of the frontier
            count = f"{len(shown)} of its {len(points)} points shown"
        out = ["", f"  frontier ({count}, * = this plan)", "        peak    recompute"]
        for i in shown:
            p = points[i]
            mark = "*" if i == chosen else " "
            out.append(
                f"  {mark} {format_bytes(p.peak_bytes):>10} {p.recompute_seconds * 1e3:>9.2f} ms"
            )
        return out

    def __repr__(self) -> str:
        recomputed = sum(d != KEEP for d in self.decisions.values())
        segs = sum(len(v) for v in self.segments.values())
        return (
            f"Plan({self.strategy}, {recomputed} units recomputed, {segs} segments, peak "
            f"{format_bytes(self.predicted_peak_bytes)}, recompute "
            f"{self.recompute_seconds * 1e3:.2f} ms)"
        )


# ---------------------------------------------------------------------- helpers


def _piece_name(unit: str, children: Sequence[int] | None) -> str:
    name = unit or "(model)"
    return name if children is None else f"{name}[{children[0]}..{children[1]}]"


def _chosen(points: list[FrontierPoint], seconds: float, peak: float) -> int:
    # The plan's own numbers can differ from its frontier point when the caller refines the
    # prediction afterwards (memfit.plan adds the loss's memory): match on time first.
    return min(
        range(len(points)),
        key=lambda i: (
            not math.isclose(points[i].recompute_seconds, seconds, rel_tol=1e-9, abs_tol=1e-15),
            abs(points[i].peak_bytes - peak),
        ),
    )


def _pieces(
    root: UnitCost, decisions: Mapping[str, str], segments: Mapping[str, list[tuple[int, int]]]
) -> list[Piece]:
    units = {u.name: u for u in root.walk()}
    saved: dict[str, float] = {}
    for u in reversed(list(root.walk())):
        saved[u.name] = u.own_saved_bytes + sum(saved[c.name] for c in u.children)
    out: list[Piece] = []
    for name, d in decisions.items():
        unit = units.get(name)
        if unit is None or d == KEEP:
            continue
        if d == RECOMPUTE:
            out.append(
                Piece(
                    name,
                    d,
                    None,
                    saved[name],
                    unit.input_bytes,
                    unit.rebuild_seconds(),
                    unit.rebuild_flops(),
                )
            )
        else:
            out.append(
                Piece(
                    name,
                    d,
                    None,
                    saved[name],
                    unit.input_bytes + unit.matmul_saved_bytes,
                    unit.selective_seconds(),
                    unit.non_matmul_fwd_flops,
                )
            )
    for name, ranges in segments.items():
        unit = units.get(name)
        if unit is None:
            continue
        for a, b in ranges:
            members = unit.children[a : b + 1]
            out.append(
                Piece(
                    name,
                    "segment",
                    (a, b),
                    sum(saved[c.name] for c in members),
                    members[0].input_bytes,
                    # The last member's tail is not run again (see UnitCost.tail_flops).
                    sum(c.fwd_seconds for c in members[:-1]) + members[-1].rebuild_seconds(),
                    sum(c.fwd_flops for c in members[:-1]) + members[-1].rebuild_flops(),
                )
            )
    return out


def _read(data: dict[str, Any], version: int) -> Plan:
    """Build a Plan from parsed JSON, checking every field's type.

    The decisions, strategy, precision and numbers are required; the other fields take
    their defaults when absent, so a hand-written plan needs little.
    """

    def field_(key: str, check: Any, what: str, default: Any = ...) -> Any:
        if key not in data:
            if default is not ...:
                return default
            raise PlanError(f"malformed memfit plan: the field {key!r} is missing")
        value = data[key]
        if not check(value):
            raise PlanError(f"malformed memfit plan: {key!r} must be {what}, got {value!r:.80}")
        return value

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    def pair(v: Any) -> bool:
        return (
            isinstance(v, list)
            and len(v) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        )

    def decisions_ok(v: Any) -> bool:
        return isinstance(v, dict) and all(
            isinstance(k, str) and x in DECISIONS for k, x in v.items()
        )

    def segments_ok(v: Any) -> bool:
        return isinstance(v, dict) and all(
            isinstance(r, list) and all(pair(x) for x in r) for r in v.values()
        )

    def structure_ok(v: Any) -> bool:
        return (
            v is None
            or isinstance(v, str)
            or (
                isinstance(v, list)
                and all(
                    isinstance(x, list) and len(x) == 2 and all(isinstance(s, str) for s in x)
                    for x in v
                )
            )
        )

    point_keys = ("peak_bytes", "recompute_seconds", "recompute_flops")

    def point_ok(p: Any) -> bool:
        # [peak, seconds, flops], or an object with the field names
        if isinstance(p, dict):
            return all(number(p.get(k)) for k in point_keys)
        return isinstance(p, list) and len(p) == 3 and all(number(x) for x in p)

    piece_numbers = ("saved_bytes", "kept_bytes", "recompute_seconds", "recompute_flops")

    def piece_ok(p: Any) -> bool:
        return (
            isinstance(p, dict)
            and isinstance(p.get("unit"), str)
            and p.get("kind") in (RECOMPUTE, SELECTIVE, "segment")
            and (p.get("children") is None or pair(p.get("children")))
            and all(number(p.get(k)) for k in piece_numbers)
        )

    decisions = field_(
        "decisions", decisions_ok, "an object of unit name to 'keep', 'recompute' or 'selective'"
    )
    segments = field_("segments", segments_ok, "an object of unit name to [start, end] pairs", {})
    structure = field_(
        "structure",
        structure_ok,
        "null, a hash string or a list of [unit name, class name] pairs",
        None,
    )
    frontier = field_(
        "frontier",
        lambda v: isinstance(v, list) and all(point_ok(p) for p in v),
        "a list of [peak bytes, seconds, flops] triples",
        [],
    )
    pieces = field_(
        "pieces",
        lambda v: isinstance(v, list) and all(piece_ok(p) for p in v),
        "a list of piece objects",
        [],
    )
    storage = field_(
        "storage",
        lambda v: (
            isinstance(v, dict) and all(isinstance(k, str) and x in CODINGS for k, x in v.items())
        ),
        f"an object of unit name to one of {', '.join(map(repr, CODINGS))}",
        {},
    )
    notes = field_(
        "notes",
        lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
        "a list of strings",
        [],
    )
    numbers = {
        key: field_(key, number, "a finite number")
        for key in (
            "predicted_peak_bytes",
            "static_bytes",
            "kept_bytes",
            "transient_bytes",
            "recompute_flops",
            "recompute_seconds",
        )
    }
    return Plan(
        decisions=dict(decisions),
        segments={k: [(a, b) for a, b in v] for k, v in segments.items()},
        strategy=field_("strategy", lambda v: isinstance(v, str), "a string"),
        budget_bytes=field_("budget_bytes", lambda v: v is None or number(v), "a number or null"),
        frontier=[
            FrontierPoint(*(tuple(p[k] for k in point_keys) if isinstance(p, dict) else p))
            for p in frontier
        ],
        precision=field_("precision", lambda v: isinstance(v, str), "a string"),
        structure=structure
        if structure is None or isinstance(structure, str)
        else [(n, c) for n, c in structure],
        notes=list(notes),
        storage=dict(storage),
        storage_seconds=field_("storage_seconds", number, "a finite number", 0.0),
        exact=field_("exact", lambda v: isinstance(v, bool), "true or false", True),
        measured_peak_bytes=field_(
            "measured_peak_bytes", lambda v: v is None or number(v), "a number or null", None
        ),
        pieces=[
            Piece(
                p["unit"],
                p["kind"],
                None if p.get("children") is None else (p["children"][0], p["children"][1]),
                *(p[k] for k in piece_numbers),
            )
            for p in pieces
        ],
        version=version,
        **numbers,
    )
