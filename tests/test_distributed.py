"""Data-parallel training through memfit on 2 gloo processes (CPU): DDP and FSDP2 equal one
process on the same global batches, reduce once per optimizer step under accumulation, skip
an overflow of one rank's gradient shard on both ranks, resume exactly from a checkpoint,
and stop every rank with an error naming the one that failed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_cases import full_weights, launch, results, toy_batch, toy_loss, toy_model

import memfit
from memfit.distributed import check_global_batch, shard_batch
from memfit.distributed.world import World
from memfit.errors import ConfigError

SPIKE = 3  # the step whose batch overflows in rank 1's half only
SHORT = 5  # a step shorter than accumulation_steps
STEPS = range(6)
CASES = [("ddp", "fp32", 1e-5), ("fsdp", "fp32", 1e-5), ("ddp", "bf16-mixed", 2e-3)]
CASES += [("fsdp", "bf16-master", 2e-3)]


def _batch(step: int) -> tuple[torch.Tensor, ...]:
    # Row 6 of 8 is in rank 1's half: its gradient overflows rows 4..7 of inp.weight only.
    return toy_batch(step, 8, (6,) if step == SPIKE else ())


def _train(engine: memfit.Engine, steps: Any, kind: str | None, feed_short: bool) -> list[float]:
    """Steps of the fixed sequence; ``kind`` None trains one process on the global batches."""

    def local(batch: Any) -> Any:
        return batch if kind is None else shard_batch(batch)

    losses = []
    for step in steps:
        batch = _batch(step)
        if step == SHORT and feed_short:  # one micro-batch of 4 for accumulation_steps=2
            engine.backward(local(tuple(t[:4] for t in batch)), toy_loss)
            loss = engine.step()
        elif step == SHORT:  # train_step of 2 samples: 1 per rank
            loss = engine.train_step(local(tuple(t[:2] for t in batch)), toy_loss)
        else:
            loss = engine.train_step(local(batch), toy_loss)
        losses.append(float(loss))
    return losses


def _engine(model: torch.nn.Module, precision: str) -> memfit.Engine:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return memfit.Engine(
        model,
        optimizer,
        precision=precision,
        accumulation_steps=2,
        clip_grad_norm=0.5,
        monitor=False,
        log_every=1000,
    )


def _parallel(kind: str, precision: str) -> torch.nn.Module:
    return memfit.parallelize(
        toy_model(), data_parallel=kind, precision=precision, units=["blocks.0", "blocks.1"]
    )


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _count_reductions(model: torch.nn.Module, kind: str, counter: list[int]) -> None:
    """Count gradient reductions: DDP's comm hook calls, FSDP2's reduce-scatters."""
    if kind == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads real annotations
            counter[0] += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
    else:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        original = group.foreach_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            counter[0] += 1
            return original(*args, **kwargs)

        group.foreach_reduce = counted


def _case(kind: str, precision: str, directory: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    feed_short = kind == "ddp"
    reference = _engine(toy_model(), precision)
    ref_losses = _train(reference, STEPS, None, feed_short)
    ref = full_weights(reference.model)

    model = _parallel(kind, precision)
    engine = _engine(model, precision)
    counter = [0]
    _count_reductions(model, kind, counter)
    flags: list[float] = []
    reduce_flag = engine.scaler._found_inf_hook

    def record(flag: torch.Tensor) -> None:
        # Whether this rank's own gradients (its shards under FSDP2) hold a non-finite value.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        flags.append(float(not all(bool(torch.isfinite(g).all()) for g in local)))
        reduce_flag(flag)

    engine.scaler.register_found_inf_hook(record)
    losses = _train(engine, range(3), kind, feed_short)
    reductions = counter[0]
    path = engine.save(directory / f"ckpt-{kind}-{precision}")
    losses += _train(engine, range(3, 6), kind, feed_short)
    final = full_weights(model)
    # The last step's norm, of the whole model's gradients (every shard's) as on one process.
    norm, ref_norm = float(engine._grad_norm), float(reference._grad_norm)
    exported = engine.model_state_dict()  # plain keys, full tensors, on every rank
    export_ok = set(exported) == set(toy_model().state_dict()) and all(
        torch.equal(exported[k], final[k]) for k in final
    )

    fresh = _parallel(kind, precision)
    optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    resumed = memfit.Engine.resume(path, fresh, optimizer)
    resumed_losses = _train(resumed, range(3, 6), kind, feed_short)
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {
        "diff_to_one_process": _max_diff(final, ref),
        "diff_resumed": _max_diff(full_weights(fresh), final),
        "resumed_losses_equal": resumed_losses == losses[3:],
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "losses": losses,
        "applied": engine.applied_steps,
        "ref_applied": reference.applied_steps,
        "reductions_in_3_steps": reductions,
        "groups": sum(isinstance(m, FSDPModule) for m in model.modules()) if kind == "fsdp" else 1,
        "spike_flag": flags[SPIKE],
        "weights_sum": sum(float(t.double().sum()) for t in final.values()),
        "local_param_bytes": sum(t.numel() * t.element_size() for t in shards),
        "full_param_bytes": sum(t.numel() * t.element_size() for t in final.values()),
        "sharded_dir": Path(path).is_dir(),
        "export_ok": export_ok,
        "final": {k: v.flatten().tolist() for k, v in final.items()},
        "norm": norm,
        "norm_diff": abs(norm - ref_norm),
    }


def _errors(directory: Path) -> dict[str, str]:
    """The ConfigErrors a data-parallel user can meet, by case."""
    errors = {}

    def expect(name: str, fn: Any) -> None:
        try:
            fn()
        except ConfigError as exc:
            errors[name] = str(exc)

    model = toy_model()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    expect("optimizer_first", lambda: memfit.parallelize(model, data_parallel="fsdp"))
    del early
    expect("ddp_master", lambda: _parallel("ddp", "bf16-master"))
    engine = _engine(_parallel("fsdp", "fp32"), "fp32")

    def short_feed() -> None:
        engine.backward(shard_batch(_batch(0)), toy_loss)
        engine.step()

    expect("fsdp_short_feed", short_feed)
    ddp_file = directory / "ckpt-ddp-fp32"
    fresh = _parallel("fsdp", "fp32")
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    expect("kind_mismatch", lambda: memfit.Engine.resume(ddp_file, fresh, opt))
    ddp = _parallel("ddp", "fp32")
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    expect(
        "engine_plans", lambda: memfit.Engine(ddp, sgd, checkpoint="auto", precision="bf16-mixed")
    )
    return errors


def _monitored(directory: Path) -> dict[str, Any]:
    """FSDP2 under the monitor, metrics read every step: rank 0 alone writes the logs."""
    model = _parallel("fsdp", "bf16-master")
    optimizer = torch.optim.AdamW(model.parameters())
    engine = memfit.Engine(
        model, optimizer, precision="bf16-master", log_every=1, log_dir=directory / "logs"
    )
    for step in range(2):
        engine.train_step(shard_batch(_batch(step)), toy_loss)
    engine.close()
    return {"metrics": sorted(engine.metrics), "log_dir": engine.log_dir is not None}


def _own_wrapping() -> dict[str, float]:
    """Models wrapped by hand (DDP's defaults; fully_shard on the blocks and the root)
    train as parallelize's do."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    by_hand = toy_model()
    for block in by_hand.blocks:
        fully_shard(block)
    fully_shard(by_hand)
    models = {
        "ddp": (DistributedDataParallel(toy_model()), _parallel("ddp", "fp32")),
        "fsdp": (by_hand, _parallel("fsdp", "fp32")),
    }
    out = {}
    for kind, pair in models.items():
        weights = []
        for model in pair:
            _train(_engine(model, "fp32"), range(3), kind, feed_short=False)
            weights.append(full_weights(model))
        out[kind] = _max_diff(*weights)
    return out


def _too_many_skips() -> int | None:
    """Rank 1's gradient shard overflows every step: the step at which each rank raises
    NonFiniteError (max_consecutive_skips=2)."""
    model = _parallel("fsdp", "fp32")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = memfit.Engine(model, optimizer, precision="fp32", max_consecutive_skips=2)
    try:
        for step in range(4):
            engine.train_step(shard_batch(toy_batch(step, 8, (6,))), toy_loss)
    except memfit.errors.NonFiniteError:
        return engine.steps
    return None


def _all_cases(rank: int, world_size: int, directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {f"{k}/{p}": _case(k, p, directory) for k, p, _ in CASES}
    out["errors"] = _errors(directory)
    out["monitored"] = _monitored(directory)
    out["own_wrapping"] = _own_wrapping()
    out["too_many_skips"] = _too_many_skips()
    return out


def test_ddp_and_fsdp2_match_one_process_skip_together_and_resume(tmp_path: Path) -> None:
    ranks = results(launch(_all_cases, tmp_path))
    for kind, precision, tol in CASES:
        name = f"{kind}/{precision}"
        r0, r1 = (r[name] for r in ranks)
        for r in (r0, r1):
            assert r["diff_to_one_process"] <= tol, (name, r["diff_to_one_process"])
            assert r["loss_diff"] <= tol, (name, r["loss_diff"])
            assert r["diff_resumed"] == 0.0 and r["resumed_losses_equal"], name
            # The spike step skipped on both ranks, as on one process: 5 of 6 applied.
            assert r["applied"] == r["ref_applied"] == 5, name
            assert r["export_ok"], name
            assert r["norm"] > 0.5 and r["norm_diff"] <= tol * r["norm"], name  # clipped
            # One reduction per optimizer step (per FSDP2 group), not per micro-batch.
            assert r["reductions_in_3_steps"] == 3 * r["groups"], name
        # Same weights and the same (global mean) loss on both ranks.
        assert r0["weights_sum"] == r1["weights_sum"], name
        assert r0["losses"] == r1["losses"], name
        if kind == "fsdp":
            # Only rank 1's shard overflowed, yet both skipped.
            assert (r0["spike_flag"], r1["spike_flag"]) == (0.0, 1.0), name
            assert r0["local_param_bytes"] == r0["full_param_bytes"] // 2, name
            assert r0["sharded_dir"], name
        else:
            assert r0["local_param_bytes"] == r0["full_param_bytes"], name
    assert ranks[0]["own_wrapping"] == {"ddp": 0.0, "fsdp": 0.0}
    assert [r["too_many_skips"] for r in ranks] == [2, 2]  # both ranks, the same step
    monitored = [r["monitored"] for r in ranks]
    assert [m["log_dir"] for m in monitored] == [True, False]
    assert {"grad/norm_total", "grad/norm_median", "loss"} <= set(monitored[0]["metrics"])
    # The 2-rank FSDP2 checkpoint resumes on 1 rank: DCP reshards it.
    one = tmp_path / "one-rank"
    one.mkdir()
    (resumed,) = results(launch(_resume_on_one_rank, one, world_size=1))
    two = ranks[0]["fsdp/fp32"]["final"]
    assert resumed.keys() == two.keys()
    for k in two:
        assert max(abs(a - b) for a, b in zip(resumed[k], two[k], strict=True)) <= 1e-5, k
    errors = ranks[0]["errors"]
    assert "build the optimizer after it" in errors["optimizer_first"]
    assert "data_parallel='fsdp'" in errors["ddp_master"]
    assert "drop_last" in errors["fsdp_short_feed"]
    assert "2 rank(s)" in errors["kind_mismatch"] and "FSDP2" in errors["kind_mismatch"]
    assert "parallelize(checkpoint=plan)" in errors["engine_plans"]


def _resume_on_one_rank(rank: int, world_size: int, directory: Path) -> dict[str, Any]:
    model = _parallel("fsdp", "fp32")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = memfit.Engine.resume(directory.parent / "ckpt-fsdp-fp32", model, optimizer)
    _train(engine, range(3, 6), "fsdp", feed_short=False)
    return {k: v.flatten().tolist() for k, v in full_weights(model).items()}


def _failing(rank: int, world_size: int, directory: Path) -> None:
    model = memfit.parallelize(toy_model(), data_parallel="ddp")
    engine = _engine(model, "fp32")

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if rank == 1 and engine.steps == 2:
            raise ValueError("a corrupt sample in this batch")
        return toy_loss(model, batch)

    for step in range(4):
        engine.train_step(shard_batch(_batch(step)), loss_fn)


def test_a_failing_rank_stops_the_other_with_its_name(tmp_path: Path) -> None:
    r0, r1 = launch(_failing, tmp_path, timeout=90)
    assert r1["type"] == "ValueError" and "corrupt sample" in r1["error"]
    assert r0["type"] == "DistributedError", r0
    assert "rank 1 failed (ValueError: a corrupt sample" in r0["error"]


def _failing_save(rank: int, world_size: int, directory: Path) -> None:
    import memfit.distributed.state_files as ckpt

    model = memfit.parallelize(toy_model(), data_parallel="ddp")
    engine = _engine(model, "fp32")
    engine.train_step(shard_batch(_batch(0)), toy_loss)
    engine.save(directory / "good.pt")
    if rank == 0:

        def full_disk(state: Any, path: Any) -> None:
            raise OSError(28, "No space left on device")

        ckpt.atomic_save = full_disk
    engine.save(directory / "second.pt")


def test_a_failed_save_on_rank_0_stops_the_others_at_once(tmp_path: Path) -> None:
    # Before, the other rank waited at a barrier for the process group's timeout (300 s,
    # longer than this launch waits).
    r0, r1 = launch(_failing_save, tmp_path, timeout=90)
    assert r0["type"] == "OSError" and "No space left" in r0["error"]
    assert r1["type"] == "DistributedError", r1
    assert "rank 0 failed to write the state file" in r1["error"]
    assert "No space left on device" in r1["error"]
    assert (tmp_path / "good.pt").exists() and not (tmp_path / "second.pt").exists()


def _failing_rename(rank: int, world_size: int, directory: Path) -> dict[str, Any]:
    import pathlib

    model = _parallel("fsdp", "fp32")
    engine = _engine(model, "fp32")
    engine.train_step(shard_batch(_batch(0)), toy_loss)
    engine.save(directory / "ck")
    saved = {k: v.flatten().tolist() for k, v in full_weights(model).items()}
    engine.train_step(shard_batch(_batch(1)), toy_loss)
    if rank == 0:
        real, failed = pathlib.Path.rename, []

        def rename(self: Path, target: Any) -> Any:
            if Path(target) == directory / "ck" and not failed:  # the new one only
                failed.append(self)
                raise OSError(13, "Permission denied")
            return real(self, target)

        pathlib.Path.rename = rename  # type: ignore[method-assign]
    try:
        engine.save(directory / "ck")
    except Exception as exc:
        fresh = _parallel("fsdp", "fp32")
        resumed = memfit.Engine.resume(directory / "ck", fresh, torch.optim.SGD(fresh.parameters()))
        weights = {k: v.flatten().tolist() for k, v in full_weights(resumed.model).items()}
        return {"error": f"{type(exc).__name__}: {exc}", "previous": weights == saved}
    return {"error": None}


def test_a_failed_fsdp2_rename_puts_the_previous_saved_state_back(tmp_path: Path) -> None:
    r0, r1 = results(launch(_failing_rename, tmp_path, timeout=120))
    assert r0["error"].startswith("PermissionError") and r0["previous"]
    assert "rank 0 failed to put the saved state in place" in r1["error"] and r1["previous"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ck")) == ["ck"]


def test_bad_input_without_a_process_group() -> None:
    with pytest.raises(ConfigError, match="torchrun.*init_process_group"):
        memfit.parallelize(toy_model(), data_parallel="fsdp")
    with pytest.raises(ConfigError, match="data_parallel must be one of"):
        memfit.parallelize(toy_model(), data_parallel="zero3")
    with pytest.raises(ConfigError, match=r"10 samples .* 4 ranks.*8, 12, 16"):
        check_global_batch(10, 4)
    with pytest.raises(ConfigError, match="multiple of 2"):
        shard_batch(toy_batch(0, 5), World(0, 2, "gloo"))
    x, _, _ = shard_batch(toy_batch(0, 8), World(1, 2, "gloo"))
    assert torch.equal(x, toy_batch(0, 8)[0][4:])


def test_per_rank_estimate_shards_weights_gradients_and_state() -> None:
    def run(world_size: int, data_parallel: str | None) -> dict[str, float]:
        est = memfit.estimate(
            toy_model,
            lambda b: toy_batch(0, b),
            batch_size=4,
            loss_fn=toy_loss,
            precisions=["fp32"],
            strategies=["none"],
            world_size=world_size,
            data_parallel=data_parallel,
        )
        return {**est.rows[0].parts, "peak": est.rows[0].peak_bytes}

    one, fsdp, ddp = run(1, None), run(2, "fsdp"), run(2, "ddp")
    assert fsdp["grads"] == one["grads"] / 2
    assert fsdp["optimizer"] == one["optimizer"] / 2
    # Sharded weights plus the root's own and two blocks' gathered (here: all of them).
    assert one["params"] / 2 < fsdp["params"] <= one["params"] * 1.5
    assert ddp["peak"] > one["peak"]  # DDP's buckets hold the gradients all step
    with pytest.raises(ConfigError, match="data_parallel must be"):
        run(2, "zero")


def test_cli_refuses_a_global_batch_the_ranks_cannot_share() -> None:
    from memfit.cli.common import UsageError
    from memfit.cli.train_command import TRAIN_DEFAULTS, _check_distributed

    settings = {**TRAIN_DEFAULTS, "batch_size": 10, "precision": "bf16-mixed"}
    with pytest.raises(UsageError, match="--batch-size: .*10 samples .*4 ranks.*8, 12, 16"):
        _check_distributed(settings, 4, check_global_batch)
    with pytest.raises(UsageError, match="bf16-mixed or fp16-mixed"):
        _check_distributed(
            {**settings, "batch_size": 8, "precision": "bf16-master"}, 2, check_global_batch
        )
    with pytest.raises(UsageError, match="--chunked-loss with --nproc"):
        _check_distributed(
            {**settings, "batch_size": 8, "chunked_loss": True}, 2, check_global_batch
        )
    _check_distributed({**settings, "batch_size": 8}, 2, check_global_batch)


def test_cli_nproc_launches_the_command_it_was_given(monkeypatch, tmp_path: Path) -> None:
    from torch.distributed import run as torchrun

    from memfit.cli.main import main

    launched: list[list[str]] = []
    monkeypatch.setattr(torchrun, "main", lambda command: launched.append(list(command)))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = str(tmp_path / "run")
    assert main(["train", "--nproc", "2", "--steps", "1", "--out", out]) == 0
    assert main(["train", "--nproc=2", "--steps", "1"]) == 0
    assert launched[0][-7:] == ["-m", "memfit", "train", "--steps", "1", "--out", out]
    assert launched[1][-5:] == ["-m", "memfit", "train", "--steps", "1"]
    assert all("--nproc-per-node" in c and "--nproc" not in c for c in launched)


def _auto_fp16(rank: int, world_size: int, directory: Path) -> dict[str, Any]:
    """precision="auto" choosing fp16-mixed (as on a GPU without bf16) under FSDP2, with an
    overflow in rank 1's shard only."""
    import memfit.precision.speed as speed

    speed.auto_candidates = lambda device: ("fp32", "fp16-mixed")  # this process only
    model = _parallel("fsdp", "fp32")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = memfit.Engine(model, optimizer, precision="auto", monitor=False, log_every=1000)
    with speed.assumed_speed("cpu", {torch.float16: 2.0}):
        for step in (0, SPIKE):
            engine.train_step(shard_batch(_batch(step)), toy_loss)
    from memfit.distributed.collectives import all_reduce_max

    return {
        "precision": engine.settings.precision,
        "applied": engine.applied_steps,
        # The scaler made for fp16 decides its skips with the other ranks.
        "reduced": engine.scaler._found_inf_hook is all_reduce_max,
    }


def test_precision_auto_choosing_fp16_decides_skips_on_every_rank(tmp_path: Path) -> None:
    r0, r1 = results(launch(_auto_fp16, tmp_path))
    assert r0["precision"] == r1["precision"] == "fp16-mixed"
    assert r0["reduced"] and r1["reduced"]
    assert r0["applied"] == r1["applied"] == 1  # the overflowed step skipped on both ranks


def _refused_plan(rank: int, world_size: int, directory: Path) -> dict[str, Any]:
    model = toy_model()
    try:
        memfit.parallelize(model, data_parallel="ddp", precision="bf16-mixed", checkpoint="sqrt")
    except ConfigError as exc:
        error = str(exc)
    patched = [n for n, m in model.named_modules() if "forward" in m.__dict__]
    return {"error": error, "patched": patched}


def test_parallelize_refusing_a_checkpoint_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    (r0,) = results(launch(_refused_plan, tmp_path, world_size=1))
    assert "takes a Plan" in r0["error"]
    assert r0["patched"] == []


def test_import_memfit_leaves_dtensor_and_fsdp_unimported() -> None:
    # They take about a second to import; nothing can be a DTensor or an FSDP2 module
    # before its module is imported, so memfit's checks do not import them.
    import subprocess
    import sys

    code = (
        "import sys, memfit, torch\n"
        "m = torch.nn.Linear(2, 2)\n"
        "assert memfit.distributed.parallel.data_parallel_kind(m) is None\n"
        "print(sorted(n for n in ('torch.distributed.tensor', 'torch.distributed.fsdp')"
        " if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    from torch.distributed.tensor import DTensor

    from memfit.distributed.world import loaded_class

    assert loaded_class("torch.distributed.tensor", "DTensor") is DTensor
    assert loaded_class("no.such.module", "Thing") is None
    assert loaded_class("torch", "float32") is None  # not a class


_GROUP_FREED = """
import gc, json, os, socket, sys
import torch
import memfit
from memfit.distributed import init_from_env

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
init_from_env("gloo")
model = memfit.parallelize(torch.nn.Linear(4, 4), data_parallel="ddp", precision="fp32")
model(torch.randn(2, 4)).sum().backward()
del model
gc.collect()
torch.distributed.destroy_process_group()
names = []
for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/comm") as f:
        names.append(f.read().strip())
print(json.dumps(names))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_destroying_the_group_after_ddp_stops_gloos_threads() -> None:
    # DDP's constructor imports torch.distributed.nn.functional, whose functions hold the
    # default group as a default argument when it is imported after the group exists:
    # then destroy_process_group cannot free the group, gloo's threads run on into the
    # interpreter's shutdown, and a rank of memfit train --nproc 2 aborted there.
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _GROUP_FREED], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    threads = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [name for name in threads if "gloo" in name], threads


def _collectives_settle(rank: int, world_size: int, directory: Path) -> dict:
    """Each of memfit's collectives once, torch.distributed's functions (torch's own helpers
    call the same ones) made to let go of their tensors late, as a gloo worker may: the
    work is complete, but a timer thread holds it 50 ms longer. Which of the tensors a call
    handed over (temporaries, recorded by weak reference) are still alive when it returns:
    only a worker can hold them then."""
    import sys
    import threading
    import weakref

    import torch.distributed as dist

    from memfit.distributed import collectives as c

    seen: list[tuple[str, Any]] = []
    timers: list[threading.Timer] = []

    def late(name: str, fn: Any) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            work = fn(tensor, *args, **{**kwargs, "async_op": True})
            work.wait()
            seen.append((name, weakref.ref(tensor)))
            holder = [work]
            del work
            timers.append(threading.Timer(0.05, holder.clear))
            timers[-1].start()

        return call

    names = ("all_reduce", "broadcast")
    originals = {name: getattr(dist.distributed_c10d, name) for name in names}
    held: dict[str, list[str]] = {}

    def check(what: str, start: int) -> None:
        held[what] = [name for name, ref in seen[start:] if ref() is not None]

    for module in (dist, dist.distributed_c10d):
        for name, fn in originals.items():
            setattr(module, name, late(name, fn))
    try:
        start = len(seen)
        votes = c.any_rank(rank == 1, False)
        check("any_rank", start)
        start = len(seen)
        chosen = c.from_rank0({"rank": rank, "text": "x" * (300 * (rank + 1))})
        check("from_rank0", start)
        start = len(seen)
        gathered = c.from_every_rank(["y" * (100 + 900 * rank), rank])  # lengths differ
        check("from_every_rank", start)
        start = len(seen)
        mean = float(c.mean_over_ranks(torch.tensor(2.0 * rank)))
        check("mean_over_ranks", start)
        # The found-inf flag is the caller's: one reference here, one getrefcount's.
        flag = torch.full((), float(rank))
        c.all_reduce_max(flag)
        held["all_reduce_max"] = ["all_reduce"] * (sys.getrefcount(flag) - 2)
    finally:
        for module in (dist, dist.distributed_c10d):
            for name, fn in originals.items():
                setattr(module, name, fn)
        for timer in timers:
            timer.join()
    return {
        "handed": len(seen),
        "held": held,
        "votes": list(votes),
        "chosen": chosen,
        "gathered": gathered,
        "mean": mean,
        "found_inf": float(flag),
    }


def test_collectives_return_once_the_worker_let_go_of_their_tensors(tmp_path: Path) -> None:
    # A gloo worker drops its reference to a collective's tensors after the collective has
    # completed, and that takes the GIL: if the main thread is destroying the group then,
    # holding the GIL while it waits for the workers, both wait for ever (a rank of memfit
    # train --nproc 2 hung at exit so, in a broadcast of broadcast_object_list's). So each
    # of memfit's collectives returns only once no worker holds its tensors.
    for rank, out in enumerate(results(launch(_collectives_settle, tmp_path))):
        assert out["handed"] >= 7
        assert out["held"] == dict.fromkeys(out["held"], []), out["held"]
        assert out["votes"] == [True, False]
        assert out["chosen"] == {"rank": 0, "text": "x" * 300}, rank
        assert out["gathered"] == [["y" * 100, 0], ["y" * 1000, 1]]
        assert out["mean"] == 1.0 and out["found_inf"] == 1.0
