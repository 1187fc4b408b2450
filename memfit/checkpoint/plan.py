"""``memfit.Plan``: which units to recompute, what that is predicted to cost, and where from.

A plan records the decisions per unit, the segments of sequential containers, the predicted
peak split into its parts, the recompute cost, the frontier it was picked from, and the
structure of the model it was made for, so it refuses to apply to a different model.

Example::

    plan = memfit.plan(model, x, budget="1GiB")
    print(plan.summary())
    text = plan.to_json()
    same = memfit.Plan.from_json(text)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from memfit.checkpoint.solve import FrontierPoint, Solution
from memfit.errors import PlanError

FORMAT = "memfit-plan"
VERSION = 1


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass
class Plan:
    """A checkpoint plan for one model under one precision.

    Example::

        plan = memfit.plan(model, x, budget="512MiB", strategy="optimal")
        plan.decisions["blocks.3"]      # "recompute"
        plan.predicted_peak_bytes       # static + kept + transient
    """

    decisions: dict[str, str]
    """Unit qualified name → ``"keep"`` | ``"recompute"`` | ``"selective"``."""
    segments: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Sequential container → inclusive child index ranges checkpointed as one piece."""
    strategy: str = "optimal"
    """The strategy that made the plan."""
    budget_bytes: float | None = None
    """The budget the plan was made for (peak of a whole step), or None."""
    predicted_peak_bytes: float = 0.0
    """static + kept + transient."""
    static_bytes: float = 0.0
    """Bytes checkpointing cannot change: parameters, gradients, optimizer state, inputs..."""
    kept_bytes: float = 0.0
    """Activation bytes held from forward to backward under the plan."""
    transient_bytes: float = 0.0
    """The largest extra bytes while one recomputed piece is rebuilt."""
    recompute_flops: float = 0.0
    """Extra forward FLOPs per step."""
    recompute_seconds: float = 0.0
    """Extra forward time per step (as profiled)."""
    frontier: list[FrontierPoint] = field(default_factory=list)
    """The (peak, recompute) trade-offs the strategy could reach, by increasing peak."""
    precision: str = "fp32"
    """The precision mode the costs were measured under."""
    structure: list[tuple[str, str]] | None = None
    """(unit name, module class) of the model the plan was made for."""
    notes: list[str] = field(default_factory=list)
    """Plain remarks, e.g. that the budget needs no checkpointing."""
    exact: bool = True
    """False when the solver had to thin its frontiers (a cheaper plan may exist)."""
    version: int = VERSION
    """The plan format version."""

    @classmethod
    def from_solution(
        cls,
        solution: Solution,
        *,
        precision: str,
        structure: list[tuple[str, str]] | None = None,
    ) -> Plan:
        """Wrap a solver :class:`~memfit.checkpoint.solve.Solution`."""
        return cls(
            decisions=dict(solution.decisions),
            segments={k: [tuple(r) for r in v] for k, v in solution.segments.items()},
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
            structure=[tuple(s) for s in structure] if structure is not None else None,
            notes=[solution.note] if solution.note else [],
            exact=solution.exact,
        )

    # ------------------------------------------------------------------ structure

    def check_structure(self, fingerprint: list[tuple[str, str]]) -> None:
        """Raise :class:`PlanError` naming the first difference from ``fingerprint``."""
        if self.structure is None:
            return
        mine = [tuple(s) for s in self.structure]
        theirs = [tuple(s) for s in fingerprint]
        if mine == theirs:
            return
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                raise PlanError(
                    f"this plan was made for a different model: unit #{i} is {a[0]!r} "
                    f"({a[1]}) in the plan but {b[0]!r} ({b[1]}) in this model. "
                    "Make a new plan for this model (memfit.plan or `memfit plan`)."
                )
        longer, n = ("plan", len(theirs)) if len(mine) > len(theirs) else ("model", len(mine))
        extra = (mine if longer == "plan" else theirs)[n]
        raise PlanError(
            f"this plan was made for a different model: the {longer} has more units, first "
            f"{extra[0]!r} ({extra[1]}). Make a new plan for this model."
        )

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> str:
        """The plan as JSON text (round-trips through :meth:`from_json`)."""
        data = asdict(self)
        data["frontier"] = [asdict(p) for p in self.frontier]
        data["segments"] = {k: [list(r) for r in v] for k, v in self.segments.items()}
        data["structure"] = [list(s) for s in self.structure] if self.structure else None
        return json.dumps({"format": FORMAT, **data}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json`; raise :class:`PlanError` if it is not one."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise PlanError(f"not a memfit plan: the text is not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanError(
                f'not a memfit plan: expected "format": "{FORMAT}"; write plans with '
                "Plan.to_json() or `memfit plan --json`"
            )
        version = data.get("version")
        if version != VERSION:
            raise PlanError(
                f"plan format version {version!r} is not supported by this memfit (reads "
                f"version {VERSION}); make the plan again with this version"
            )
        try:
            return cls(
                decisions={str(k): str(v) for k, v in data["decisions"].items()},
                segments={
                    str(k): [(int(a), int(b)) for a, b in v]
                    for k, v in data.get("segments", {}).items()
                },
                strategy=str(data["strategy"]),
                budget_bytes=data.get("budget_bytes"),
                predicted_peak_bytes=float(data["predicted_peak_bytes"]),
                static_bytes=float(data["static_bytes"]),
                kept_bytes=float(data["kept_bytes"]),
                transient_bytes=float(data["transient_bytes"]),
                recompute_flops=float(data["recompute_flops"]),
                recompute_seconds=float(data["recompute_seconds"]),
                frontier=[FrontierPoint(**p) for p in data.get("frontier", [])],
                precision=str(data["precision"]),
                structure=[(str(a), str(b)) for a, b in data["structure"]]
                if data.get("structure") is not None
                else None,
                notes=[str(n) for n in data.get("notes", [])],
                exact=bool(data.get("exact", True)),
                version=VERSION,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed memfit plan: {type(exc).__name__}: {exc}") from None

    # ------------------------------------------------------------------ display

    def summary(self) -> str:
        """A readable table: decisions, the predicted peak by part, cost, and the frontier."""
        lines = [
            f"checkpoint plan · strategy {self.strategy} · precision {self.precision}"
            + (f" · budget {_fmt(self.budget_bytes)}" if self.budget_bytes else " · no budget"),
            "",
        ]
        changed = {n: d for n, d in self.decisions.items() if d != "keep"}
        if changed or self.segments:
            lines.append(f"  {'unit':<40} decision")
            for name, decision in changed.items():
                lines.append(f"  {name or '(model)':<40} {decision}")
            for name, ranges in self.segments.items():
                for a, b in ranges:
                    lines.append(f"  {(name or '(model)') + f'[{a}..{b}]':<40} recompute (segment)")
        else:
            lines.append("  nothing is recomputed")
        lines += [
            "",
            f"  predicted peak   {_fmt(self.predicted_peak_bytes):>12}",
            f"    static         {_fmt(self.static_bytes):>12}  (params, grads, optimizer, inputs, loss)",
            f"    kept           {_fmt(self.kept_bytes):>12}  (activations held for backward)",
            f"    transient      {_fmt(self.transient_bytes):>12}  (largest piece rebuilt in backward)",
            f"  recompute        {self.recompute_flops / 1e9:>9.3f} GFLOP  {self.recompute_seconds * 1e3:.2f} ms/step",
        ]
        if self.frontier:
            lines += [
                "",
                f"  frontier ({len(self.frontier)} points, the planner's bound)      peak    recompute",
            ]
            points = self.frontier
            if len(points) > 12:
                step = (len(points) - 1) / 11
                points = [points[round(i * step)] for i in range(12)]
            for p in points:
                same = abs(p.recompute_seconds - self.recompute_seconds) <= 1e-9 * max(
                    1.0, self.recompute_seconds
                )
                mark = " ◀ chosen" if same else ""
                lines.append(
                    f"    {_fmt(p.peak_bytes):>22} {p.recompute_seconds * 1e3:>9.2f} ms{mark}"
                )
        for note in self.notes:
            lines += ["", f"  note: {note}"]
        if not self.exact:
            lines.append("  note: frontiers were thinned; a slightly cheaper plan may exist")
        return "\n".join(lines)

    def __repr__(self) -> str:
        recomputed = sum(d != "keep" for d in self.decisions.values())
        segs = sum(len(v) for v in self.segments.values())
        return (
            f"Plan({self.strategy}, {recomputed} units recomputed, {segs} segments, "
            f"peak {_fmt(self.predicted_peak_bytes)}, recompute {self.recompute_flops / 1e9:.2f} GFLOP)"
        )
