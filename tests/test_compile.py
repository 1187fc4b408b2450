"""Checkpoint plans under torch.compile: compiled recompute trains as the eager plan does.

Every compile here uses the ``aot_eager`` backend: Dynamo and AOTAutograd (where
checkpointing is traced and partitioned) run, and the graphs execute with eager kernels,
so a test takes seconds instead of inductor's minutes of C++ compilation. The gradients
are compared with ``rtol=1e-5, atol=1e-7`` in fp32 on CPU: AOTAutograd may reorder float
ops (on this machine they come out bitwise equal).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import memfit
from memfit.checkpoint import find_units, plan
from memfit.checkpoint.apply import applied_plan, is_applied
from memfit.checkpoint.recompute import selective_contexts
from memfit.errors import ConfigError
from memfit.models import build_model

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("one_thread")]

RTOL, ATOL = 1e-5, 1e-7


class Spy:
    """An aot_eager backend that records, per compiled graph, its checkpointed regions."""

    def __init__(self) -> None:
        self.regions: list[list[Any]] = []  # each region's context_fn (None: plain)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        regions = []
        for node in gm.graph.nodes:
            if "tag_activation_checkpoint" in str(node.target):
                body = gm.get_submodule(node.args[0].target)
                regions.append(body.meta.get("_checkpoint_context_fn"))
        self.regions.append(regions)
        backend = torch._dynamo.backends.registry.lookup_backend("aot_eager")
        return backend(gm, example_inputs)


@pytest.fixture(scope="module")
def gpt() -> Any:
    torch.manual_seed(0)
    return build_model("gpt", n_layer=2, n_embd=32, n_head=2, block_size=32, data="synthetic")


def _grads(model: torch.nn.Module, batch: torch.Tensor, loss_fn: Any) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn(model, batch).backward()
    return {
        n.replace("_orig_mod.", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


@pytest.fixture(scope="module")
def plans(gpt: Any) -> dict[str, Any]:
    model, loss_fn, batch_fn = gpt
    batch = batch_fn(2, generator=0)
    compiled = torch.compile(copy.deepcopy(model), backend="aot_eager")
    # Plans made on the compiled model: its names are the model's own.
    return {
        "full": plan(compiled, batch, loss_fn, strategy="full", precision="fp32"),
        "uniform:2": plan(compiled, batch, loss_fn, strategy="uniform:2", precision="fp32"),
        "selective": {"blocks.0": "selective", "blocks.1": "selective"},
    }


@pytest.mark.parametrize(
    "name, regions",
    [("full", [None, None]), ("uniform:2", [None]), ("selective", [selective_contexts] * 2)],
)
def test_compiled_plan_trains_as_the_eager_plan(
    gpt: Any, plans: dict[str, Any], name: str, regions: list[Any]
) -> None:
    model, loss_fn, batch_fn = gpt
    batch = batch_fn(2, generator=1)
    plan = plans[name]
    eager = copy.deepcopy(model)
    memfit.apply_plan(eager, plan)
    expected = _grads(eager, batch, loss_fn)
    assert expected.keys() == dict(model.named_parameters()).keys()

    torch._dynamo.reset()
    spy = Spy()
    planned = copy.deepcopy(model)
    memfit.apply_plan(planned, plan)  # precision -> plan -> compile
    got = _grads(torch.compile(planned, backend=spy), batch, loss_fn)
    # The plan is compiled in: one checkpointed region per piece, selective ones with
    # memfit's policy, none dropped by a graph break.
    assert spy.regions == [regions]
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=RTOL, atol=ATOL)


def test_plan_names_and_application_look_through_the_compile_wrapper(
    gpt: Any, plans: dict[str, Any]
) -> None:
    model, loss_fn, batch_fn = gpt
    batch = batch_fn(2, generator=2)
    plan = plans["full"]
    assert all("_orig_mod" not in n for n in plan.decisions)
    assert all("_orig_mod" not in n for n, _ in plan.structure)
    torch._dynamo.reset()
    spy = Spy()
    inner = copy.deepcopy(model)
    compiled = torch.compile(inner, backend=spy)
    assert find_units(compiled).names() == find_units(model).names() == list(plan.decisions)

    _grads(compiled, batch, loss_fn)  # compiled unplanned first
    memfit.apply_plan(compiled, plan)  # a plan of the compiled model, applied after a step
    assert is_applied(inner) and is_applied(compiled) and applied_plan(compiled) is plan
    got = _grads(compiled, batch, loss_fn)
    # Applying the plan changed the forwards: Dynamo traced them again, checkpointed.
    assert spy.regions == [[], [None, None]]
    memfit.remove_plan(compiled)
    assert not is_applied(inner)

    eager = copy.deepcopy(model)
    memfit.apply_plan(eager, plan)
    expected = _grads(eager, batch, loss_fn)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=RTOL, atol=ATOL)


def test_blocks_compiled_one_by_one_are_refused_with_the_order_that_works(gpt: Any) -> None:
    model, loss_fn, batch_fn = gpt
    torch._dynamo.reset()
    per_block = copy.deepcopy(model)
    per_block.blocks[1] = torch.compile(per_block.blocks[1], backend="aot_eager")
    with pytest.raises(ConfigError, match=r"'blocks\.1' .*precision -> plan -> compile"):
        memfit.apply_plan(per_block, {"blocks.0": "recompute"})
    with pytest.raises(ConfigError, match="compile its blocks"):
        plan(per_block, batch_fn(2, generator=0), loss_fn, strategy="full", precision="fp32")
    assert not is_applied(per_block)


def test_engine_trains_a_compiled_model_with_a_plan(gpt: Any) -> None:
    model, loss_fn, batch_fn = gpt
    losses = {}
    spy = Spy()
    for compiled in (False, True):
        torch._dynamo.reset()
        net = copy.deepcopy(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        if compiled:
            net = torch.compile(net, backend=spy)
        engine = memfit.Engine(net, opt, precision="fp32", checkpoint="full", log_every=1)
        losses[compiled] = [engine.train_step(batch_fn(2, generator=i), loss_fn) for i in range(3)]
        assert engine.plan.decisions["blocks.0"] == "recompute"
        assert "act/max/blocks.0" in engine.metrics  # the monitor's names: no "_orig_mod."
    # The steps ran compiled, checkpointed (the first one is measured by memfit.measure,
    # whose dispatch mode must not make Dynamo skip the model for good); the monitor's
    # sampled and unsampled forwards are two graphs.
    assert 1 <= len(spy.regions) <= 2
    assert all(regions == [None, None] for regions in spy.regions)
    for a, b in zip(losses[True], losses[False]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_a_measured_first_call_leaves_the_model_compiled(gpt: Any) -> None:
    model, loss_fn, batch_fn = gpt
    batch = batch_fn(2, generator=3)
    torch._dynamo.reset()
    spy = Spy()
    planned = memfit.apply_plan(copy.deepcopy(model), {"blocks.0": "recompute"})
    compiled = torch.compile(planned, backend=spy)
    report = memfit.measure(lambda: loss_fn(compiled, batch).backward(), model=compiled)
    assert spy.regions == [[None]]  # compiled on that first, measured call
    assert report.peak_bytes > 0
    loss_fn(compiled, batch).backward()
    assert spy.regions == [[None]]  # and the compiled graph is used from then on


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_a_compiled_run_saves_a_checkpoint_an_uncompiled_model_resumes(
    gpt: Any, tmp_path: Any, precision: str
) -> None:
    model, loss_fn, batch_fn = gpt
    torch._dynamo.reset()
    net = copy.deepcopy(model)
    compiled = torch.compile(net, backend="aot_eager")
    engine = memfit.Engine(
        compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), precision=precision, log_every=1
    )
    engine.train_step(batch_fn(2, generator=0), loss_fn)
    path = engine.save(tmp_path / "c.pt")
    assert not any("_orig_mod." in key for key in engine.state_dict()["model"])
    assert not any("_orig_mod." in key for key in engine.model_state_dict())
    fresh = copy.deepcopy(model)
    resumed = memfit.Engine.resume(path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    for (name, a), b in zip(net.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    if precision != "fp32":  # the masters too, under the uncompiled names
        assert resumed.master.names == engine.master.names
        assert not any("_orig_mod." in n for n in engine.master.names)
        for a, b in zip(engine.master.masters, resumed.master.masters):
            assert torch.equal(a, b)
    assert resumed.steps == 1
