"""The planner's activation storage: which kept units store their saved tensors coded.

Beside keep and recompute, a unit may keep what it saves in fewer bytes
(:mod:`memfit.checkpoint.storage`: bf16, int8, fp8, or off the device). The planner decides it
with the same solver and budget, in three measured steps on the example batch:

1. **What each unit would code** (:func:`~memfit.checkpoint.storage.codable`): one forward
   with every candidate unit probed by the rule training uses. Candidates are the
   children of the outermost chains (a GPT's layers; the built-in ResNet's stages, its
   outermost chain), else the root's children.
2. **What each storage costs in gradient**: the gradients of one step with every
   candidate stored that way, against the exact ones (same RNG), as a relative L2 error
   ``|g - g*| / |g*|``. A storage whose error passes ``tolerance`` is not offered.
3. **The solve**: for each storage offered, sets of candidates (each prefix of them
   ordered by the bytes they save, most first and least first) are made leaves that keep
   their coded bytes, and the solver plans the rest, once with those leaves kept and once
   free to recompute them (a recomputed unit leaves the set: its checkpoint holds its
   tensors). A plan counts where the whole step's count fits. The least cost wins
   (below), and it is used only where it costs less than keeping everything as it is,
   or fits where that cannot: a unit is stored only where the budget needs it.

Coding takes time too (a cast per tensor each way; fp8 also a max and a scale; offload
two copies over the host link), weighed with the recompute: a plan's cost is its
recompute time plus, per stored unit, the bytes it codes times the storage's time per
byte (:func:`coding_rates`). Measured where the recompute is (the step of 2. timed
against the exact one, with every candidate stored), counted from bytes where it is
counted (``costs="counted"``, the estimator). The least cost wins (ties: fewer units
stored, then the least lossy storage), and storage is used only where that cost is below
the recompute without it, or fits where that cannot: a storage slower than the
recompute it saves is not chosen (fp8 on a CPU without fp8 conversions, offload where
the link is slow).

A stored unit's forward holds its tensors uncoded until it returns (they are coded then,
when nothing else holds them): its moment holds them and their codes at once, which the
prediction counts; its backward decodes one op's tensors at a time, the largest counted.

:func:`step_storage_choice` runs the three steps on the planner's profiled step;
:func:`choose_storage` is the third alone, on any cost tree.

Example::

    choice = choose_storage(root, candidates, codes, errors, solve_at, fits, plain)
    choice.storage     # {"blocks.6": "fp8", "blocks.7": "fp8"}
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from memfit.checkpoint.apply import suspended
from memfit.checkpoint.costs import COUNTED_BANDWIDTH, KEEP, UnitCost
from memfit.checkpoint.profile_stage import ModelProfile
from memfit.checkpoint.solvers import Solution, plan_cost, solve
from memfit.checkpoint.step_memory import StepMemory
from memfit.checkpoint.storage import CODINGS, Codable, apply_storage, codable, remove_storage
from memfit.errors import BudgetError
from memfit.precision.apply import precision_applied
from memfit.precision.kernels import module_device
from memfit.precision.policy import PrecisionPolicy

__all__ = [
    "CODED",
    "COUNTED_PASSES",
    "DEFAULT_TOLERANCE",
    "StorageChoice",
    "StorageTrials",
    "candidate_units",
    "choose_storage",
    "coding_rates",
    "measure_codable",
    "step_storage_choice",
    "stored_tree",
    "try_storages",
]

#: The storages that code (beside keep and recompute), least lossy first (offload, exact,
#: last: it is offered on CUDA only).
CODED = CODINGS

#: The largest relative L2 gradient error a storage may add on the example batch.
DEFAULT_TOLERANCE = 0.05

#: Counted coding time, in bytes moved per byte coded over the counted bandwidth
#: (:data:`~memfit.checkpoint.costs.COUNTED_BANDWIDTH`), forward and backward: a bf16 cast
#: reads an fp32 tensor and writes half of it, and backward the reverse (3); fp8 also
#: takes the max and scales in fp32 both ways (about 8), int8 the same per block (8);
#: offload's copies cross the host link both ways, counted at a sixteenth of the device's
#: bandwidth (32).
COUNTED_PASSES = {"bf16": 3.0, "int8": 8.0, "fp8": 8.0, "offload": 32.0}


@dataclass(frozen=True)
class StorageChoice:
    """The storage the planner chose and the solution it planned with."""

    storage: dict[str, str]
    """Stored unit → storage (only those the budget needs)."""
    solution: Solution
    """The solve on the tree with those units coded."""
    tree: UnitCost
    """That tree (stored units as leaves keeping their coded bytes)."""
    errors: dict[str, float | None]
    """Each storage tried, its measured relative gradient error (None: not measured,
    on the meta device, where it is taken as within the tolerance)."""
    coding_seconds: float = 0.0
    """What coding the stored units' tensors adds to a step, in the solution's time."""


def candidate_units(root: UnitCost) -> list[str]:
    """The units a storage may be applied to: the blocks of every chain (the children of
    sequential units, not nested in one another), else the root's children.

    Example::

        candidate_units(result.profile.root)   # ['blocks.0', 'blocks.1', ...]
    """
    found: list[str] = []

    def visit(unit: UnitCost) -> None:
        if unit.sequential and unit.children:
            found.extend(c.name for c in unit.children)
            return
        for child in unit.children:
            visit(child)

    visit(root)
    if not found:
        found = [c.name for c in root.children]
    return [n for n in found if n]


def measure_codable(
    model: nn.Module, units: list[str], forward: Callable[[], Any]
) -> dict[str, Codable]:
    """:func:`~memfit.checkpoint.storage.codable`, with gradients on (nothing is saved
    without them) and the outputs dropped."""
    with torch.enable_grad():
        return codable(model, units, forward)


class StorageTrials(NamedTuple):
    """The example step run with every candidate stored each way (:func:`try_storages`)."""

    errors: dict[str, float]
    """Per storage, the relative L2 error of the gradients against the exact step."""
    seconds: dict[str, float]
    """Per storage, the step's time."""
    exact_seconds: float
    """The exact step's time (the faster of two runs, one before the storages and one
    after: the first run of a step pays for warming up)."""


def try_storages(
    model: nn.Module,
    graded: list[torch.Tensor],
    step: Callable[[], None],
    units: list[str],
    storages: list[str],
) -> StorageTrials:
    """Per storage, the relative L2 error of the gradients of ``graded`` after ``step()``
    (a forward and backward) with every unit of ``units`` stored that way, against the
    exact step, both from the same RNG state, and each step's time. The gradients are
    put back as they were.

    Example::

        try_storages(model, list(model.parameters()), step, ["blocks.0"], ["fp8"]).errors
    """
    saved = [t.grad for t in graded]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    device = next((t.device for t in graded), torch.device("cpu"))

    def run() -> tuple[list[torch.Tensor | None], float]:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for t in graded:
            t.grad = None
        _synchronize(device)
        start = time.perf_counter()
        step()
        _synchronize(device)
        seconds = time.perf_counter() - start
        return [None if t.grad is None else t.grad.detach().float() for t in graded], seconds

    errors: dict[str, float] = {}
    seconds: dict[str, float] = {}
    try:
        exact, first = run()
        norm = sum(float(g.pow(2).sum()) for g in exact if g is not None) ** 0.5
        for storage in storages:
            apply_storage(model, {u: storage for u in units})
            try:
                got, seconds[storage] = run()
            finally:
                remove_storage(model)
            diff = sum(
                float((a - b).pow(2).sum())
                for a, b in zip(got, exact)
                if a is not None and b is not None
            )
            errors[storage] = diff**0.5 / norm if norm > 0 else 0.0
        again = run()[1] if storages else first
    finally:
        for t, g in zip(graded, saved):
            t.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return StorageTrials(errors, seconds, min(first, again))


def coding_rates(
    storages: list[str],
    codes: Mapping[str, Codable],
    units: list[str],
    trials: StorageTrials | None,
) -> dict[str, float]:
    """Per storage, the seconds coding takes per byte coded (forward and backward).

    Measured (``trials``: the step with every unit of ``units`` stored, against the exact
    one): the time it added over the bytes those units code, none where it added none.
    Counted (``trials=None``: counted costs, the meta device):
    :data:`COUNTED_PASSES` over :data:`~memfit.checkpoint.costs.COUNTED_BANDWIDTH`.

    Example::

        >>> coding_rates(["fp8"], {}, [], None)
        {'fp8': 8e-10}
    """
    if trials is None:
        return {k: COUNTED_PASSES[k] / COUNTED_BANDWIDTH for k in storages}
    rates: dict[str, float] = {}
    for kind in storages:
        coded = sum(codes[u].coded_from_bytes(kind) for u in units)
        added = trials.seconds.get(kind, trials.exact_seconds) - trials.exact_seconds
        rates[kind] = max(0.0, added) / coded if coded > 0 else 0.0
    return rates


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work: a time taken on the host counts all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stored_tree(
    root: UnitCost,
    storage: Mapping[str, str],
    codes: Mapping[str, Codable],
    frozen: bool = False,
) -> UnitCost:
    """``root`` with each unit of ``storage`` made a leaf that keeps its subtree's saved
    bytes less what its storage saves, and holds, at the end of its forward, the coded
    tensors and their codes at once, and in its backward what comes back at once
    (:meth:`~memfit.checkpoint.storage.Codable.back_bytes`).
    ``frozen``: the stored leaves cannot be recomputed (the solver then plans the rest).

    Example::

        tree = stored_tree(root, {"blocks.0": "fp8"}, codes)
    """

    def visit(unit: UnitCost) -> UnitCost:
        kind = storage.get(unit.name)
        if kind is None:
            return dataclasses.replace(unit, children=[visit(c) for c in unit.children])
        code = codes[unit.name]
        below = list(unit.walk())
        saved = unit.total_saved_bytes()
        coded = code.coded_bytes(kind)
        return dataclasses.replace(
            unit,
            children=[],
            sequential=False,
            can_recompute=unit.can_recompute and not frozen,
            own_saved_bytes=max(0.0, saved - code.total_bytes() + coded),
            own_saved_after_children_bytes=0.0,
            forward_hold_bytes=max(
                max(u.forward_hold_bytes for u in below), float(code.total_bytes())
            ),
            backward_hold_bytes=max(u.backward_hold_bytes for u in below)
            + float(code.back_bytes(kind)),
            forward_workspace_bytes=max(u.forward_workspace_bytes for u in below),
            rebuild_forward_bytes=max(u.rebuild_forward_bytes for u in below),
            backward_workspace_bytes=max(u.backward_workspace_bytes for u in below),
        )

    return visit(root)


def _within(unit: str, outer: str) -> bool:
    return unit == outer or not outer or unit.startswith(outer + ".")


def _recomputed(solution: Solution) -> list[str]:
    """The units a solution recomputes: decided so, or members of its segments."""
    found = [u for u, d in solution.decisions.items() if d != KEEP]
    for container, ranges in solution.segments.items():
        prefix = f"{container}." if container else ""
        found += [f"{prefix}{i}" for a, b in ranges for i in range(a, b + 1)]
    return found


class _Stored(NamedTuple):
    """A legal plan with storage: what is stored, the tree it is solved on, the solution."""

    storage: dict[str, str]
    tree: UnitCost
    solution: Solution


@dataclass(frozen=True)
class _Search:
    """Legal plans with a given storage (a recomputed unit's tensors are its checkpoint's,
    never coded): ``solve_at(tree)`` solves a cost tree under the budget (None: nothing
    fits), ``fits(tree, solution)`` judges a solution by the whole step's count (the
    solver's peak leaves out what a stored unit's moments hold beside its codes: its
    tensors before coding, one decoded in backward)."""

    root: UnitCost
    codes: Mapping[str, Codable]
    solve_at: Callable[[UnitCost], Solution | None]
    fits: Callable[[UnitCost, Solution], bool]
    rates: Mapping[str, float]

    def coding_seconds(self, storage: Mapping[str, str]) -> float:
        """What coding ``storage``'s units takes per step (:func:`coding_rates`)."""
        return sum(
            self.codes[u].coded_from_bytes(k) * self.rates.get(k, 0.0) for u, k in storage.items()
        )

    def cost(self, stored: _Stored) -> float:
        """A legal plan's time beside the step: its recompute and its coding."""
        return stored.solution.recompute_seconds + self.coding_seconds(stored.storage)

    def legal(self, storage: dict[str, str]) -> _Stored | None:
        """The cheaper of :meth:`kept` and :meth:`freed` (None: neither fits)."""
        found = [c for c in (self.kept(storage), self.freed(storage)) if c is not None]
        return min(found, key=self.cost) if found else None

    def kept(self, storage: dict[str, str]) -> _Stored | None:
        """Every stored unit kept, the solver planning the rest."""
        tree = stored_tree(self.root, storage, self.codes, frozen=True)
        solution = self.solve_at(tree)
        if solution is None or not self.fits(tree, solution):
            return None
        recomputed = _recomputed(solution)  # a unit holding a stored one may be
        if any(_within(u, r) for u in storage for r in recomputed):
            return None
        return _Stored(storage, tree, solution)

    def freed(self, storage: dict[str, str]) -> _Stored | None:
        """The solver free to recompute stored units, those it recomputes dropped from
        the storage and the tree solved again, until it recomputes none."""
        while storage:
            tree = stored_tree(self.root, storage, self.codes)
            solution = self.solve_at(tree)
            if solution is None:
                return None
            recomputed = _recomputed(solution)
            kept = {
                u: k
                for u, k in storage.items()
                if not any(_within(u, r) or _within(r, u) for r in recomputed)
            }
            if kept == storage:
                return _Stored(storage, tree, solution) if self.fits(tree, solution) else None
            storage = kept
        return None


def choose_storage(
    root: UnitCost,
    candidates: list[str],
    codes: Mapping[str, Codable],
    errors: Mapping[str, float | None],
    solve_at: Callable[[UnitCost], Solution | None],
    fits: Callable[[UnitCost, Solution], bool],
    plain: Solution | None,
    tolerance: float = DEFAULT_TOLERANCE,
    rates: Mapping[str, float] | None = None,
) -> StorageChoice | None:
    """The storage plan that costs least under the budget (its recompute and its coding),
    or None where none costs less than ``plain`` (the solve without storage; None: it
    found no plan).

    ``solve_at(tree)`` solves a cost tree under the budget (None: nothing fits);
    ``fits(tree, solution)`` says whether a solution fits by the whole step's count;
    ``rates``: each storage's coding seconds per byte (:func:`coding_rates`; None: free).

    Example::

        choice = choose_storage(root, units, codes, errors, solve_at, fits, plain, rates=rates)
    """
    search = _Search(root, codes, solve_at, fits, rates or {})
    best: _Stored | None = None
    for kind in CODED:
        error = errors.get(kind, float("inf"))
        if error is not None and error > tolerance:
            continue
        useful = [u for u in candidates if codes[u].coded_bytes(kind) < codes[u].total_bytes()]
        if not useful:
            continue
        # Sets of units tried: each prefix of them ordered by what they save, most first
        # and least first (a unit whose forward moment is the step's peak gains nothing
        # stored: its moment holds its tensors and their codes at once). The least cost
        # is taken; ties go to fewer units stored, so only those the budget needs are.
        useful.sort(key=lambda u: codes[u].coded_bytes(kind) - codes[u].total_bytes())
        tried: set[frozenset[str]] = set()
        for order in (useful, useful[::-1]):
            for count in _prefix_sizes(len(order)):
                units = frozenset(order[:count])
                if units in tried:
                    continue
                tried.add(units)
                legal = search.legal({u: kind for u in order[:count]})
                if legal is None:
                    continue
                if best is None or (search.cost(legal), len(legal.storage)) < (
                    search.cost(best),
                    len(best.storage),
                ):
                    best = legal
    if best is None:
        return None
    if plain is not None and search.cost(best) >= plain.recompute_seconds:
        return None
    return StorageChoice(
        best.storage, best.solution, best.tree, dict(errors), search.coding_seconds(best.storage)
    )


#: Above this many candidates, prefixes of that many evenly spaced sizes are tried.
_PREFIXES = 32


def _prefix_sizes(n: int) -> list[int]:
    """The prefix lengths tried of ``n`` candidates: each, or about :data:`_PREFIXES` of
    them evenly spaced (the whole set always among them).

    >>> _prefix_sizes(3)
    [1, 2, 3]
    >>> _prefix_sizes(100)[:3], _prefix_sizes(100)[-1]
    ([3, 6, 9], 100)
    """
    if n <= _PREFIXES:
        return list(range(1, n + 1))
    return sorted({max(1, round(n * (i + 1) / _PREFIXES)) for i in range(_PREFIXES)})


def step_storage_choice(
    model: nn.Module,
    profiled: ModelProfile,
    mem: StepMemory,
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer | None,
    root: UnitCost,
    strategy: str,
    budget_bytes: float,
    coded: list[str],
    tolerance: float,
    plain: Solution | None,
    reserve: float,
) -> StorageChoice | None:
    """:func:`choose_storage` on the profiled step: what each candidate would code and
    each storage's gradient error, measured on the example batch under the training
    precision (counted on a meta model, whose error is assumed within the tolerance);
    ``plain``, the plan without storage; None where storage does not pay.

    Example::

        choice = step_storage_choice(model, profiled, mem, policy, optimizer, root,
                                     "optimal", budget, ["fp8"], DEFAULT_TOLERANCE, plain, 0.02)
    """
    run_loss = profiled.run_loss
    assert run_loss is not None
    units = candidate_units(root)
    if not units:
        return None
    device = module_device(model)
    graded = list(
        {
            id(t): t
            for t in [
                *model.parameters(),
                *([p for g in optimizer.param_groups for p in g["params"]] if optimizer else []),
            ]
            if t.requires_grad
        }.values()
    )

    def forward() -> Any:
        if device.type == "meta":  # the estimator's step autocasts on its fake device
            return run_loss()
        with policy.autocast(device.type):
            return run_loss()

    def step() -> None:
        forward().backward()

    # Measured without the plan the model may carry (the Engine re-plans with one
    # applied), which is put back as it was.
    with suspended(model), precision_applied(model, policy):
        codes = measure_codable(model, units, forward)
        trials = None if device.type == "meta" else try_storages(model, graded, step, units, coded)
    errors: dict[str, float | None] = (
        dict.fromkeys(coded) if trials is None else dict(trials.errors)
    )
    # Coding time as the recompute's is: measured, or counted with counted costs.
    rates = coding_rates(coded, codes, units, None if profiled.counted else trials)

    def solve_at(tree: UnitCost) -> Solution | None:
        try:
            return solve(
                tree,
                strategy,
                budget_bytes,
                mem.held_bytes,
                mem.loss_bytes,
                reserve=reserve,
                frontier=False,
            )
        except BudgetError:
            return None

    def fits(tree: UnitCost, solution: Solution) -> bool:
        peak = plan_cost(
            tree,
            solution.decisions,
            solution.segments,
            mem.held_bytes,
            mem.loss_bytes,
            shared_inputs=True,
        ).peak_bytes
        return max(peak, mem.floor_bytes) <= budget_bytes * (1 - reserve)

    return choose_storage(root, units, codes, errors, solve_at, fits, plain, tolerance, rates)
