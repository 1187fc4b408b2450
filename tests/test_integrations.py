"""The Hugging Face Trainer and Lightning callbacks on tiny models, on CPU, a few steps."""

from __future__ import annotations

import copy
import importlib
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from memfit.checkpoint.apply import applied_plan, is_applied
from memfit.errors import BudgetError, ConfigError
from memfit.integrations.common import (
    DEFAULT_KEYS,
    RunMetrics,
    ScaleWatcher,
    example_batch,
    require,
)
from memfit.precision.optimizer_state import state_bits

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pl = pytest.importorskip("lightning.pytorch")

from memfit.integrations import hf  # noqa: E402
from memfit.integrations import lightning as mf_lightning  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


# --------------------------------------------------------------------------- Hugging Face


class _Tokens(torch.utils.data.Dataset):
    """Fixed token windows with labels: the model computes its own loss."""

    def __init__(self, n: int = 16, length: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


def _args(tmp_path: Path, **kw: Any) -> Any:
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(kw)
    return transformers.TrainingArguments(**settings)


def _train(model: nn.Module, args: Any, callbacks: list[Any]) -> Any:
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks
    )
    trainer.train()
    return trainer


def _train_logs(trainer: Any) -> list[dict[str, float]]:
    return [h for h in trainer.state.log_history if "loss" in h]


def test_hf_plan_applied_and_metrics_logged(tmp_path: Path) -> None:
    model = _gpt2()
    callback = hf.MemfitCallback(strategy="full", verbose=False)
    trainer = _train(model, _args(tmp_path), [callback])
    assert is_applied(model)
    decisions = applied_plan(model).decisions
    assert decisions["transformer.h.0"] == decisions["transformer.h.1"] == "recompute"
    assert model.transformer.h[0]._memfit_patch.decision == "recompute"
    logs = _train_logs(trainer)
    assert len(logs) == 2
    for line in logs:
        assert torch.isfinite(torch.tensor(line["loss"]))
        assert line["memfit/plan/predicted_peak_bytes"] == callback.plan.predicted_peak_bytes
        assert line["memfit/recompute/overhead"] > 0
        assert line["memfit/plan/measured_peak_bytes"] > 0
        assert line["memfit/health/warnings"] == 0.0
        # By default a handful of keys, the ones a user acts on; verbose=True logs all.
        ours = {k.removeprefix("memfit/") for k in line if k.startswith("memfit/")}
        assert ours <= set(DEFAULT_KEYS)
        assert "memfit/plan/recomputed_units" not in line
        assert "memfit/memory/kind/activations" not in line
    # the training summary line gets them too, and fp32 has no loss scaler
    assert "memfit/plan/predicted_peak_bytes" in trainer.state.log_history[-1]
    assert not any(k.startswith("memfit/amp/") for k in logs[0])
    assert model.config.use_cache is False
    # The measured forward and backward is judged, never acted on (one plan for the run).
    verdict = callback.run.verdict
    assert verdict is not None and verdict.action == "keep" and verdict.fits
    assert verdict.measured_bytes == callback.run.measured_peak_bytes
    assert verdict.predicted_bytes == callback.plan.predicted_peak_bytes


class _Recorder(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append(dict(logs))


def test_hf_attach_puts_the_keys_before_every_reporter(tmp_path: Path) -> None:
    args = _args(tmp_path, max_steps=1)
    trainer = transformers.Trainer(model=_gpt2(), args=args, train_dataset=_Tokens())
    reporter = _Recorder()  # stands for a report_to callback: called before user callbacks
    trainer.callback_handler.callbacks.insert(0, reporter)
    callback = hf.MemfitCallback(strategy="full", measure_memory=False, verbose=False)
    assert callback.attach(trainer) is callback
    assert trainer.callback_handler.callbacks[:2] == [callback, reporter]
    trainer.train()
    assert "memfit/plan/predicted_peak_bytes" in reporter.logs[0]
    assert callback.run is not None and callback.run.verdict is None  # nothing measured


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_hf_one_step_with_the_plan_equals_one_without(tmp_path: Path, build: Any) -> None:
    base = build()
    planned = copy.deepcopy(base)
    planned.config.use_cache = base.config.use_cache = False
    _train(base, _args(tmp_path / "a", max_steps=1), [])
    callback = hf.MemfitCallback(strategy="full", measure_memory=False, verbose=False)
    _train(planned, _args(tmp_path / "b", max_steps=1), [callback])
    assert callback.plan.recompute_flops > 0
    for (name, p), q in zip(base.named_parameters(), planned.parameters()):
        assert torch.equal(p, q), name


def test_hf_optimal_plan_fits_a_tight_budget(tmp_path: Path) -> None:
    model = _llama()
    unplanned = hf.MemfitCallback(strategy="none", measure_memory=False, verbose=False)
    _train(copy.deepcopy(model), _args(tmp_path / "a", max_steps=1), [unplanned])
    whole = unplanned.plan.predicted_peak_bytes
    floor = hf.MemfitCallback(strategy="full", measure_memory=False, verbose=False)
    _train(copy.deepcopy(model), _args(tmp_path / "b", max_steps=1), [floor])
    budget = int((whole + floor.plan.predicted_peak_bytes) / 2)
    assert floor.plan.predicted_peak_bytes < budget < whole
    callback = hf.MemfitCallback(budget=budget, verbose=False)
    trainer = _train(model, _args(tmp_path / "c"), [callback])
    assert callback.plan.predicted_peak_bytes <= budget
    assert any(d != "keep" for d in callback.plan.decisions.values())
    assert _train_logs(trainer)[-1]["memfit/plan/budget_bytes"] == budget


def test_hf_activation_checkpointing_is_turned_off_and_said(tmp_path: Path) -> None:
    model = _gpt2()
    callback = hf.MemfitCallback(strategy="full", measure_memory=False, verbose=False)
    args = _args(tmp_path, max_steps=1, gradient_checkpointing=True)
    with pytest.warns(UserWarning, match="turned off Hugging Face activation checkpointing"):
        _train(model, args, [callback])
    # The property's name since transformers 5.0 (the older one stays as an alias in 5.x).
    assert not getattr(model, "is_activation_checkpointing", model.is_gradient_checkpointing)
    assert is_applied(model)


def test_hf_bf16_trains_under_bf16_mixed(tmp_path: Path) -> None:
    model = _gpt2()
    callback = hf.MemfitCallback(strategy="full", measure_memory=False, verbose=False)
    trainer = _train(model, _args(tmp_path, bf16=True, gradient_accumulation_steps=2), [callback])
    assert callback.plan.precision == "bf16-mixed"
    assert callback.run.result.accumulation_steps == 2
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in _train_logs(trainer))


def test_trainer_precision_maps_the_flags() -> None:
    assert hf.trainer_precision(SimpleNamespace(bf16=True, fp16=False)) == "bf16-mixed"
    assert hf.trainer_precision(SimpleNamespace(bf16=False, fp16=True)) == "fp16-mixed"
    assert hf.trainer_precision(SimpleNamespace(bf16=False, fp16=False)) == "fp32"


def _begin(callback: Any, tmp_path: Path, model: nn.Module, loader: Any) -> None:
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    args = _args(tmp_path)
    callback.on_train_begin(args, state, control, model=model, train_dataloader=loader)


def test_hf_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="memory size"):
        hf.MemfitCallback(budget="lots")
    with pytest.raises(ConfigError, match="k must be a whole number"):
        hf.MemfitCallback(strategy="uniform:0")
    assert hf.MemfitCallback(budget=0.5).budget == 0.5  # of the model's device, at train begin
    with pytest.raises(ConfigError, match="pass example_batch="):
        _begin(hf.MemfitCallback(), tmp_path, _gpt2(), None)
    stream = torch.utils.data.DataLoader(_Stream(), batch_size=2)
    with pytest.raises(ConfigError, match="IterableDataset"):
        _begin(hf.MemfitCallback(), tmp_path, _gpt2(), stream)
    unlabeled = {"input_ids": _Tokens().ids[:2]}
    with pytest.raises(ConfigError, match="put labels in the batch"):
        _begin(hf.MemfitCallback(example_batch=unlabeled), tmp_path, _gpt2(), None)
    with pytest.raises(BudgetError, match="optimizer step alone"):
        _train(_gpt2(), _args(tmp_path), [hf.MemfitCallback(budget=1024, verbose=False)])


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        yield {"input_ids": torch.zeros(4, dtype=torch.long)}


def test_example_batch_is_the_first_batch_and_moves_no_random_state() -> None:
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=3, shuffle=True)
    state = torch.random.get_rng_state()
    batch = example_batch(loader, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(batch["input_ids"], _Tokens().ids[:3])


# --------------------------------------------------------------------------- scaler and imports


def test_scale_watcher_counts_skipped_steps() -> None:
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    watcher = ScaleWatcher(scaler)
    skipped = []
    for value in (1.0, float("inf"), 1.0):
        opt.zero_grad()
        scaler.scale((param * value).sum()).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(watcher.step_skipped())
    assert skipped == [False, True, False]
    assert ScaleWatcher(torch.amp.GradScaler("cpu", enabled=False)).scaler is None


def test_run_metrics_report_the_scaler(tmp_path: Path) -> None:
    model = _gpt2()
    callback = hf.MemfitCallback(strategy="full", measure_memory=False, verbose=False)
    _train(model, _args(tmp_path, max_steps=1), [callback])
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # the scale tensor exists from the first scaled loss
    metrics = RunMetrics(callback.run, scaler)
    metrics.observe_step()
    scaler.update(4.0)  # what a skipped step does to the scale
    metrics.observe_step()
    out = metrics.log_metrics(loss=1.0)
    assert out["memfit/amp/skipped"] == 1.0
    assert out["memfit/amp/overflow_rate"] == 0.5
    assert "memfit/amp/scale" not in out  # every metric with verbose=True only
    # an fp32 plan: the scaler's checks do not apply, so no warning comes from the rate
    assert out["memfit/health/warnings"] == 0.0
    verbose = RunMetrics(callback.run, scaler, verbose=True)
    verbose.observe_step()
    every = verbose.log_metrics(loss=1.0)
    assert every["memfit/amp/scale"] == 4.0
    assert every["memfit/plan/recomputed_units"] == 2.0
    assert set(out) < set(every)


def test_a_verbose_callback_logs_every_metric(tmp_path: Path) -> None:
    model = _gpt2()
    callback = hf.MemfitCallback(strategy="full", verbose=True)
    line = _train_logs(_train(model, _args(tmp_path, max_steps=1), [callback]))[-1]
    assert line["memfit/plan/recomputed_units"] == 2.0
    assert line["memfit/memory/kind/activations"] > 0
    assert line["memfit/plan/static_bytes"] > 0


def test_missing_framework_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImportError, match=r"pip install 'memfit\[integrations\]'"):
        require(["memfit_no_such_framework"], "memfit.integrations.x")
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.delitem(sys.modules, "memfit.integrations.lightning")
    with pytest.raises(ImportError, match=r"needs lightning.*memfit\[integrations\]"):
        importlib.import_module("memfit.integrations.lightning")


def test_memfit_imports_without_the_frameworks() -> None:
    code = (
        "import sys, memfit, memfit.integrations, memfit.integrations.common; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- Lightning


class _Blocks(pl.LightningModule):
    """Four MLP blocks and a head; training_step calls ``self(x)``, or ``self.net(x)``
    with ``direct=True``."""

    def __init__(self, direct: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)]
        self.net = nn.Sequential(*blocks, nn.Linear(16, 1))
        self.direct = direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        out = self.net(x) if self.direct else self(x)
        loss = nn.functional.mse_loss(out.squeeze(-1), y)
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 16, generator=g), torch.randn(64, generator=g)
    )
    return torch.utils.data.DataLoader(data, batch_size=16)


def _fit(module: nn.Module, callbacks: list[Any], steps: int = 2, **kw: Any) -> Any:
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=callbacks,
        **kw,
    )
    trainer.fit(module, _loader())
    return trainer


def test_lightning_plan_applied_and_metrics_logged() -> None:
    module = _Blocks()
    callback = mf_lightning.MemfitCallback(strategy="full", verbose=False)
    trainer = _fit(module, [callback])
    assert is_applied(module)
    assert [d for n, d in applied_plan(module).decisions.items() if d != "keep"]
    assert module.net[0]._memfit_patch.decision == "recompute"
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train_loss"])
    assert metrics["memfit/plan/predicted_peak_bytes"] == callback.plan.predicted_peak_bytes
    assert metrics["memfit/recompute/overhead"] > 0
    assert "memfit/memory/kind/activations" not in metrics  # verbose=True logs it
    assert metrics["memfit/health/warnings"] == 0


def test_lightning_one_step_with_the_plan_equals_one_without() -> None:
    base = _Blocks()
    planned = copy.deepcopy(base)
    _fit(base, [], steps=1)
    callback = mf_lightning.MemfitCallback(strategy="full", measure_memory=False, verbose=False)
    _fit(planned, [callback], steps=1)
    assert callback.plan.recompute_flops > 0
    for (name, p), q in zip(base.named_parameters(), planned.parameters()):
        assert torch.equal(p, q), name


def _fake_trainer(**kw: Any) -> SimpleNamespace:
    settings: dict[str, Any] = dict(
        train_dataloader=_loader(),
        optimizers=[],
        precision="32-true",
        accumulate_grad_batches=1,
        global_step=0,
        scaler=None,
    )
    settings.update(kw)
    return SimpleNamespace(**settings)


def test_lightning_precision_and_accumulation_reach_the_planner() -> None:
    module = _Blocks().eval()
    callback = mf_lightning.MemfitCallback(strategy="full", verbose=False)
    callback.on_train_start(
        _fake_trainer(precision="bf16-mixed", accumulate_grad_batches=3), module
    )
    assert not module.training  # planned and measured in train mode, modes put back
    assert callback.run.report.by_dtype["torch.bfloat16"] > 0  # measured under autocast
    assert callback.plan.precision == "bf16-mixed"
    assert callback.run.result.accumulation_steps == 3
    assert mf_lightning.lightning_precision("16-mixed") == "fp16-mixed"
    assert mf_lightning.lightning_precision("32-true") == "fp32"
    with pytest.raises(ConfigError, match="cannot plan under Lightning precision '64-true'"):
        mf_lightning.lightning_precision("64-true")


def test_lightning_true_precisions_plan_under_the_master_mode_without_warning() -> None:
    # Lightning trains "bf16-true" itself; memfit only plans it, over-predicting.
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert mf_lightning.lightning_precision("bf16-true") == "bf16-master"
        assert mf_lightning.lightning_precision("16-true") == "fp16-master"


def test_lightning_module_names_the_planned_submodule() -> None:
    module = _Blocks(direct=True)  # training_step calls self.net, never self(x)
    callback = mf_lightning.MemfitCallback(
        strategy="full", module="net", measure_memory=False, verbose=False
    )
    callback.on_train_start(_fake_trainer(), module)
    assert applied_plan(module.net) is callback.plan
    assert callback.plan.decisions["0"] == "recompute"  # names relative to the submodule
    with pytest.raises(ConfigError, match="no such submodule"):
        mf_lightning.MemfitCallback(module="body").on_train_start(_fake_trainer(), module)


def test_lightning_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="memory size"):
        mf_lightning.MemfitCallback(budget=-1)
    with pytest.raises(ConfigError, match="pass example_batch="):
        mf_lightning.MemfitCallback().on_train_start(
            _fake_trainer(train_dataloader=None), _Blocks()
        )


def test_lightning_advice_is_said_in_lightnings_settings() -> None:
    # A budget no plan meets: the error names Lightning's knobs, not memfit's Engine's.
    callback = mf_lightning.MemfitCallback(budget="1KiB", verbose=False)
    with pytest.raises(BudgetError) as raised:
        _fit(_Blocks(), [callback], precision="bf16-mixed")
    said = str(raised.value)
    assert "Trainer(precision='bf16-true')" in said
    assert "'*-master' precision" not in said and "*-master mode" not in said


def test_a_slow_bf16_cpu_is_said_in_the_frameworks_settings() -> None:
    from memfit.precision.speed import assumed_speed

    callback = mf_lightning.MemfitCallback(strategy="full", verbose=False)
    with assumed_speed("cpu", {torch.bfloat16: 0.2}):
        with pytest.warns(UserWarning, match=r"0\.20x .* use Trainer\(precision='32-true'\)"):
            _fit(_Blocks(), [callback], steps=1, precision="bf16-mixed")
    fast = mf_lightning.MemfitCallback(strategy="full", verbose=False)
    with assumed_speed("cpu", {torch.bfloat16: 2.0}), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*slower than in fp32.*")
        _fit(_Blocks(), [fast], steps=1, precision="bf16-mixed")


def test_health_remedies_are_said_in_the_loops_settings() -> None:
    from memfit.integrations.terms import HF_TERMS

    said = HF_TERMS.say(
        "most memory is fp32: use a *-master mode so weights and gradients are 16-bit, "
        "check that outputs are not cast to float early"
    )
    assert "dtype=torch.bfloat16" in said and "*-master mode" not in said


def test_a_second_run_reads_its_plan_back_and_a_changed_model_plans_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memfit.integrations import common

    first = mf_lightning.MemfitCallback(strategy="full", verbose=False, plan_cache=tmp_path)
    _fit(_Blocks(), [first], steps=1)
    kept = list(tmp_path.glob("*.json"))
    assert first.run is not None and first.run.result is not None
    assert kept == [first.run.kept_in]

    def no_planning(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("planned again although the plan was kept")

    with monkeypatch.context() as patch:
        patch.setattr(common, "plan_model", no_planning)
        second = mf_lightning.MemfitCallback(strategy="full", verbose=False, plan_cache=tmp_path)
        module = _Blocks()
        _fit(module, [second], steps=1)
    assert second.run is not None and second.run.result is None
    assert second.run.kept_in == first.run.kept_in
    assert applied_plan(module) == first.plan
    assert second.run.measured_peak_bytes == first.run.measured_peak_bytes
    # Another budget, or another model, is another plan.
    other = mf_lightning.MemfitCallback(strategy="sqrt", verbose=False, plan_cache=tmp_path)
    _fit(_Blocks(), [other], steps=1)
    assert other.run is not None and other.run.result is not None
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_damaged_kept_plan_is_planned_again_with_a_warning(tmp_path: Path) -> None:
    first = mf_lightning.MemfitCallback(strategy="full", verbose=False, plan_cache=tmp_path)
    _fit(_Blocks(), [first], steps=1)
    assert first.run is not None and first.run.kept_in is not None
    first.run.kept_in.write_text("{not json", encoding="utf-8")
    again = mf_lightning.MemfitCallback(strategy="full", verbose=False, plan_cache=tmp_path)
    with pytest.warns(UserWarning, match="ignoring the kept plan"):
        _fit(_Blocks(), [again], steps=1)
    assert again.run is not None and again.run.result is not None  # planned
    assert again.plan == first.plan
    text = first.run.kept_in.read_text(encoding="utf-8")
    assert text.startswith("{") and "plan" in text  # written anew
    none = mf_lightning.MemfitCallback(strategy="full", verbose=False, plan_cache=None)
    _fit(_Blocks(), [none], steps=1)
    assert none.run is not None and none.run.kept_in is None


def _tuned(precision: str, checkpoint: str = "optimal", world_size: int = 1) -> SimpleNamespace:
    from memfit.candidates import Candidate
    from memfit.tuning.result import TuneRow

    best = Candidate(precision, checkpoint, 8, 4, 2e6, 0.1, 0.05, True)
    return SimpleNamespace(best=TuneRow(best, 0), budget=3 * 2**20, world_size=world_size)


def test_a_tuned_choice_is_said_in_each_frameworks_arguments(tmp_path: Path) -> None:
    from memfit.integrations.tuned import tuned_loop

    loop = tuned_loop(_tuned("bf16-mixed"), "hf")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **loop.arguments)
    assert (args.bf16, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (
        True,
        8,
        4,
    )
    assert loop.callback == {"strategy": "optimal", "budget": 3 * 2**20}
    hf.MemfitCallback(**loop.callback)  # the callback takes its settings as they are
    light = tuned_loop(_tuned("fp32", "sqrt"), "lightning")
    trainer = pl.Trainer(accelerator="cpu", logger=False, **light.arguments)
    assert trainer.accumulate_grad_batches == 4 and str(trainer.precision) == "32-true"
    assert light.batch_size == 8 and light.callback == {"strategy": "sqrt", "budget": None}
    mf_lightning.MemfitCallback(**light.callback)
    with pytest.raises(ConfigError, match="precisions=memfit.integrations.tuned.LOOP_PRECISIONS"):
        tuned_loop(_tuned("bf16-master"), "hf")
    with pytest.raises(ConfigError, match="tuned for several ranks"):
        tuned_loop(_tuned("fp32", world_size=2), "lightning")


def test_the_plan_key_tells_a_changed_forward_even_without_a_source_file() -> None:
    # Classes made with exec (a notebook, generated code) have no source to read: their
    # compiled code names them, so an edited forward is another plan.
    from memfit.integrations.plan_cache import plan_key

    def made(step: int) -> nn.Module:
        namespace: dict[str, Any] = {"nn": nn}
        code = "class Net(nn.Linear):\n    def forward(self, x):\n        return super().forward(x) + {}\n"
        exec(code.format(step), namespace)
        torch.manual_seed(0)
        return namespace["Net"](4, 4)

    batch = torch.zeros(2, 4)
    first, same, edited = made(1), made(1), made(2)
    assert plan_key(first, batch, None, {}) == plan_key(same, batch, None, {})
    assert plan_key(first, batch, None, {}) != plan_key(edited, batch, None, {})
    assert plan_key(first, batch, None, {}) != plan_key(first, torch.zeros(3, 4), None, {})


class _AdamBlocks(_Blocks):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_trains_with_eight_bit_state() -> None:
    # Lightning steps the optimizer with its closure (training_step and backward inside):
    # the 8-bit step runs it, then updates.
    planned = _AdamBlocks()
    callback = mf_lightning.MemfitCallback(
        strategy="full", measure_memory=False, optimizer_state="8bit"
    )
    trainer = _fit(planned, [callback], steps=3)
    optimizer = trainer.optimizers[0]
    assert state_bits(optimizer) == "8bit"
    assert len(optimizer.state) == len(list(planned.parameters()))
    assert all(isinstance(s["exp_avg"], dict) for s in optimizer.state.values())
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert trainer.global_step == 3
