"""memfit.Plan: from a solution, JSON round trips and refusals, structure checks, summary."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.plan import FORMAT, VERSION, Piece, Plan, structure_hash
from memfit.checkpoint.solvers import FrontierPoint, solve
from memfit.errors import PlanError

MIB = float(2**20)


def _tree() -> UnitCost:
    blocks = [
        UnitCost(
            f"h.{i}",
            own_saved_bytes=96 * MIB,
            input_bytes=4 * MIB,
            fwd_seconds=0.002,
            fwd_flops=3e9,
            matmul_saved_bytes=48 * MIB,
            non_matmul_fwd_seconds=0.0005,
            non_matmul_fwd_flops=1e8,
        )
        for i in range(8)
    ]
    return UnitCost("", children=blocks, sequential=True)


def _plan(budget: float = 1.5 * 2**30) -> Plan:
    tree = _tree()
    sol = solve(tree, "optimal", budget, static_bytes=2**30)
    return Plan.from_solution(
        sol,
        precision="bf16-mixed",
        structure=[("", "GPT"), *((f"h.{i}", "Block") for i in range(8))],
        units_info=tree,
    )


# --------------------------------------------------------------------------- from a solution


def test_from_solution_copies_the_solution() -> None:
    tree = _tree()
    sol = solve(tree, "uniform:2", None, static_bytes=2**30)
    plan = Plan.from_solution(sol, precision="bf16-mixed", structure="ab" * 32, units_info=tree)
    assert plan.decisions == sol.decisions
    assert plan.segments == {"": [(0, 1), (2, 3), (4, 5), (6, 7)]}
    assert plan.predicted_peak_bytes == sol.predicted_peak_bytes
    assert (plan.static_bytes, plan.kept_bytes, plan.transient_bytes) == (
        sol.static_bytes,
        sol.kept_bytes,
        sol.transient_bytes,
    )
    # Times are counted in steps of 2**-40 s, so that equal plans tie exactly.
    assert plan.recompute_seconds == pytest.approx(0.016, rel=1e-9)
    assert plan.recompute_flops == 24e9
    assert plan.frontier == sol.frontier
    assert plan.strategy == "uniform:2" and plan.version == VERSION
    assert plan.structure == "ab" * 32
    # Four segments of two blocks: each saves 192 MiB, keeps the first one's 4 MiB input.
    assert plan.pieces == [
        Piece("", "segment", (2 * i, 2 * i + 1), 192 * MIB, 4 * MIB, 0.004, 6e9) for i in range(4)
    ]


def test_notes_come_from_the_solution() -> None:
    plan = _plan(budget=8 * 2**30)
    assert plan.notes == [
        "budget 8.00 GiB is at or above the no-checkpoint peak 1.75 GiB: nothing is recomputed"
    ]


# --------------------------------------------------------------------------- JSON


def test_json_round_trip_of_a_solved_plan() -> None:
    plan = _plan()
    text = plan.to_json()
    data = json.loads(text)
    assert data["format"] == FORMAT and data["version"] == VERSION
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text


names = st.text(min_size=0, max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False)
bytes_ = st.one_of(st.integers(0, 2**50), st.floats(0, 2**50, allow_nan=False))


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    units = draw(st.lists(names, unique=True, max_size=8))
    structure = draw(
        st.one_of(
            st.none(),
            st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
            st.lists(st.tuples(names, names), max_size=6),
        )
    )
    return Plan(
        decisions={u: draw(st.sampled_from(["keep", "recompute", "selective"])) for u in units},
        segments=draw(
            st.dictionaries(
                names, st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=4)
            )
        ),
        strategy=draw(st.sampled_from(["optimal", "full", "uniform:3", "sqrt", "none"])),
        budget_bytes=draw(st.one_of(st.none(), bytes_)),
        predicted_peak_bytes=draw(bytes_),
        static_bytes=draw(bytes_),
        kept_bytes=draw(bytes_),
        transient_bytes=draw(bytes_),
        recompute_flops=draw(finite),
        recompute_seconds=draw(finite),
        frontier=[FrontierPoint(*p) for p in draw(st.lists(st.tuples(bytes_, finite, finite)))],
        precision=draw(st.sampled_from(["fp32", "bf16-mixed", "fp16-master"])),
        structure=structure,
        notes=draw(st.lists(st.text(max_size=40), max_size=3)),
        exact=draw(st.booleans()),
        pieces=[
            Piece(u, k, c, a, b, s, f)
            for u, k, c, a, b, s, f in draw(
                st.lists(
                    st.tuples(
                        names,
                        st.sampled_from(["recompute", "selective", "segment"]),
                        st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(0, 9))),
                        bytes_,
                        bytes_,
                        finite,
                        finite,
                    ),
                    max_size=4,
                )
            )
        ],
    )


@settings(max_examples=150, deadline=None)
@given(plans())
def test_json_round_trip_is_exact(plan: Plan) -> None:
    again = Plan.from_json(plan.to_json())
    assert again == plan
    # Exact to the bit, not just equal: -0.0 and 0.0 compare equal but are not the same.
    for a, b in zip(again.frontier, plan.frontier):
        assert math.copysign(1, a.recompute_seconds) == math.copysign(1, b.recompute_seconds)


def _data() -> dict:
    return json.loads(_plan().to_json())


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ("[1, 2]", "not a memfit plan"),
        ('{"decisions": {}}', "not a memfit plan"),
        ('{"format": "memfit-profile", "version": 1}', "'memfit-profile'"),
    ],
)
def test_from_json_refuses_what_is_not_a_plan(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Plan.from_json(text)


def test_from_json_refuses_a_newer_version() -> None:
    data = _data()
    data["version"] = VERSION + 1
    with pytest.raises(PlanError, match=r"newer memfit.*Upgrade memfit"):
        Plan.from_json(json.dumps(data))


@pytest.mark.parametrize("version", [0, -1, "1", 1.0, True, None])
def test_from_json_refuses_odd_versions(version: object) -> None:
    data = _data()
    data["version"] = version
    with pytest.raises(PlanError, match="version"):
        Plan.from_json(json.dumps(data))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("decisions", {"h.0": "maybe"}, "'decisions'"),
        ("decisions", [], "'decisions'"),
        ("segments", {"": [[0]]}, "'segments'"),
        ("segments", {"": [[0, 1.5]]}, "'segments'"),
        ("predicted_peak_bytes", "1GiB", "'predicted_peak_bytes'"),
        ("budget_bytes", True, "'budget_bytes'"),
        ("frontier", [[1, 2]], "'frontier'"),
        ("structure", [["a"]], "'structure'"),
        ("notes", "hello", "'notes'"),
        ("exact", "yes", "'exact'"),
        ("pieces", [{"unit": "a"}], "'pieces'"),
    ],
)
def test_from_json_names_the_bad_field(field: str, value: object, message: str) -> None:
    data = _data()
    data[field] = value
    with pytest.raises(PlanError, match=message):
        Plan.from_json(json.dumps(data))


def test_from_json_names_a_missing_field() -> None:
    data = _data()
    del data["kept_bytes"]
    with pytest.raises(PlanError, match="'kept_bytes' is missing"):
        Plan.from_json(json.dumps(data))


def test_to_json_refuses_non_finite_numbers() -> None:
    plan = _plan()
    plan.kept_bytes = math.nan
    with pytest.raises(PlanError, match="NaN or infinity"):
        plan.to_json()


# --------------------------------------------------------------------------- structure


def test_check_structure_accepts_the_same_model() -> None:
    plan = _plan()
    plan.check_structure([("", "GPT"), *((f"h.{i}", "Block") for i in range(8))])
    plan.check_structure(structure_hash(plan.structure))  # type: ignore[arg-type]


def test_check_structure_names_the_first_difference() -> None:
    plan = _plan()
    model = [("", "GPT"), *((f"h.{i}", "Block") for i in range(8))]
    model[3] = ("h.2", "MoEBlock")
    with pytest.raises(
        PlanError, match=r"unit #3 is 'h.2' \(Block\) in the plan but 'h.2' \(MoEBlock\)"
    ):
        plan.check_structure(model)
    with pytest.raises(PlanError, match=r"the model has more units, the first extra one is 'h.8'"):
        plan.check_structure([*plan.structure, ("h.8", "Block")])  # type: ignore[misc]
    with pytest.raises(PlanError, match=r"the plan has more units, the first extra one is 'h.7'"):
        plan.check_structure(plan.structure[:-1])  # type: ignore[index]


def test_check_structure_with_hashes() -> None:
    model = [("", "GPT"), ("h.0", "Block")]
    hashed = Plan({}, structure=structure_hash(model))
    hashed.check_structure(model)
    hashed.check_structure(structure_hash(model))
    with pytest.raises(PlanError, match="structure hash"):
        hashed.check_structure([("", "GPT"), ("h.0", "Other")])
    listed = Plan({}, structure=model)
    with pytest.raises(PlanError, match="structure hash"):
        listed.check_structure(structure_hash([("", "Other")]))


def test_a_plan_without_structure_accepts_any_model() -> None:
    Plan({}).check_structure([("", "Anything")])


def test_structure_hash_is_stable_and_order_sensitive() -> None:
    a = structure_hash([("", "GPT"), ("h.0", "Block")])
    assert a == structure_hash([["", "GPT"], ["h.0", "Block"]])
    assert a != structure_hash([("h.0", "Block"), ("", "GPT")])
    assert len(a) == 64


# --------------------------------------------------------------------------- summary


def test_summary_shows_the_key_numbers() -> None:
    plan = _plan()
    text = plan.summary()
    assert "strategy optimal" in text and "precision bf16-mixed" in text
    assert "budget 1.50 GiB" in text
    for label, value in [
        ("predicted peak", plan.predicted_peak_bytes),
        ("static", plan.static_bytes),
        ("kept", plan.kept_bytes),
        ("transient", plan.transient_bytes),
    ]:
        line = next(row for row in text.splitlines() if row.strip().startswith(label))
        assert _fmt(value) in line
    assert f"{plan.recompute_flops / 1e9:.2f} GFLOP" in text
    assert f"{plan.recompute_seconds * 1e3:.2f} ms per step" in text
    # Every recomputed piece is listed with what it frees.
    for piece in plan.pieces:
        assert _fmt(piece.saved_bytes - piece.kept_bytes) in text
    chosen = [row for row in text.splitlines() if row.lstrip().startswith("*")]
    assert len(chosen) == 1 and _fmt(plan.predicted_peak_bytes) in chosen[0]
    assert all(line == line.rstrip() for line in text.splitlines())


def test_summary_without_costs_lists_names_and_notes() -> None:
    tree = _tree()
    sol = solve(tree, "uniform:3", None)
    plan = Plan.from_solution(sol, precision="fp32")
    text = plan.summary()
    assert "(model)[0..2]" in text and "(model)[3..5]" in text and "segment" in text
    assert "frees" not in text
    plan.exact = False
    plan.notes = ["a remark"]
    text = plan.summary()
    assert "note: a remark" in text and "slightly cheaper one may exist" in text


def test_summary_cuts_long_lists() -> None:
    plan = Plan({f"u{i}": "recompute" for i in range(100)})
    text = plan.summary(max_rows=10)
    assert "... and 90 more pieces" in text


def test_repr_is_one_line() -> None:
    assert repr(_plan()).startswith("Plan(optimal, ")
    assert "\n" not in repr(_plan())


def _fmt(n: float) -> str:
    from memfit.units import format_bytes

    return format_bytes(n)


def test_from_json_fills_optional_fields() -> None:
    numbers = dict.fromkeys(
        (
            "predicted_peak_bytes",
            "static_bytes",
            "kept_bytes",
            "transient_bytes",
            "recompute_flops",
            "recompute_seconds",
        ),
        0,
    )
    text = json.dumps(
        {
            "format": FORMAT,
            "version": 1,
            "decisions": {"h.0": "recompute"},
            "strategy": "full",
            "precision": "fp32",
            "budget_bytes": None,
            "frontier": [{"peak_bytes": 5, "recompute_seconds": 1.0, "recompute_flops": 2.0}],
            "pieces": [
                {
                    "unit": "h.0",
                    "kind": "recompute",
                    "saved_bytes": 4,
                    "kept_bytes": 1,
                    "recompute_seconds": 1.0,
                    "recompute_flops": 2.0,
                }
            ],
            **numbers,
        }
    )
    plan = Plan.from_json(text)
    assert plan.segments == {} and plan.structure is None and plan.notes == []
    assert plan.exact and plan.frontier == [FrontierPoint(5, 1.0, 2.0)]
    assert plan.pieces == [Piece("h.0", "recompute", None, 4, 1, 1.0, 2.0)]


def test_the_summary_says_how_many_frontier_points_it_lists() -> None:
    from memfit.checkpoint.plan import Plan
    from memfit.checkpoint.solvers.frontier import FrontierPoint

    points = [FrontierPoint(float(1000 - i), float(i) / 1e3, 0.0) for i in range(12)]
    plan = Plan(decisions={}, frontier=points, recompute_seconds=0.0, predicted_peak_bytes=1000.0)
    text = plan.summary()
    listed = [line for line in text.splitlines() if line.strip().endswith(" ms")]
    assert f"frontier ({len(listed)} of its 12 points shown" in text
    few = Plan(decisions={}, frontier=points[:3], predicted_peak_bytes=1000.0)
    assert "frontier (3 points" in few.summary()
