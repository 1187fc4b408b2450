"""Preemption: ``memfit train`` killed with SIGKILL at random moments, the same command run
again each time, against an uninterrupted run; and how long a save stalls training.

1. **Kills.** The uninterrupted run first, its phases timed (start-up, training, the end).
   ``--kills`` moments are drawn at random over its timeline; the same command is started
   again and again, each start SIGKILLed at the next moment (measured from where its resume
   point lies on that timeline; a moment already behind it kills the start-up) until every
   kill has landed; then once more to the end. The table says what each kill left on disk (the newest state
   file, a save cut short, the summary) and what the next start did. The final state
   (weights, optimizer, scaler, schedule, random generators, counters) is compared with
   the uninterrupted run's bitwise.
2. **Stall.** In this process: the median step time, and the median time of
   ``Engine.save`` (what a step waits for: the state dict, the SHA-256 digest, the
   serialization, the fsyncs) with its parts, for the same model.

    python bench/preemption.py                       # the tables in docs/preemption.md
    python bench/preemption.py --kills 10 --seed 3
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MODEL = ["--set", "n_layer=2", "--set", "n_embd=128", "--set", "block_size=64"]
RUN = ["--data", "synthetic", "--precision", "fp32", "--batch-size", "8"]
RUN += ["--eval-every", "50", "--eval-batches", "2", "--log-every", "10"]


def _env() -> dict[str, str]:
    # Unbuffered: a killed process's last lines are in its log.
    return {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}


def _command(out: str, steps: int, save_every: int) -> list[str]:
    args = [*MODEL, *RUN, "--steps", str(steps), "--save-every", str(save_every)]
    return [sys.executable, "-m", "memfit", "train", *args, "--out", out]


def _newest_step(run: Path) -> int:
    from memfit.cli.run_dir import state_files, step_of

    files = state_files(run)
    return (step_of(files[0]) or 0) if files else 0


def _on_disk(run: Path) -> str:
    """What a kill left: the newest state file, a save cut short, the summary."""
    from memfit.cli.run_dir import partial_files, state_files

    files = state_files(run)
    parts = [files[0].name if files else "no state file"]
    if not (run / "config.json").exists():
        parts.append("no config.json")
    if partial_files(run):
        parts.append("a save cut short")
    if (run / "summary.json").exists():
        parts.append("summary.json")
    return ", ".join(parts)


def _moment(run: Path, steps: int, was_finished: bool) -> str:
    """When the kill came, from what it left."""
    from memfit.cli.run_dir import partial_files

    if was_finished:
        return "a finished run's start"
    if not (run / "config.json").exists():
        return "start-up"
    if partial_files(run):
        return "in a save"
    newest = _newest_step(run)
    if newest == 0:
        return "before the first save"
    if newest == steps:
        summary = (run / "summary.json").exists()
        return "after the last step" + (" (summary written)" if summary else "")
    return "between saves"


def _started(output: str) -> str:
    """What a start did, from its first lines."""
    did = "killed in start-up, before it printed"
    for line in output.splitlines():
        if line.startswith("memfit train "):
            did = "a new run"
        for key in ("resumed ", "restarted ", "is finished"):
            if key in line:
                did = line.strip().split(";")[0].split(" with its")[0]
    if "a save cut short by a kill" in output:
        did += " (removed the temp file of a save cut short)"
    return did


def kills(args: argparse.Namespace, work: Path) -> bool:
    rng = random.Random(args.seed)
    reference = work / "reference"
    # The uninterrupted run, its phases timed: start-up (until config.json), training
    # (until the last state file), the end (summary, report).
    started = time.perf_counter()
    process = subprocess.Popen(
        _command("reference", args.steps, args.save_every),
        cwd=work,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marks: dict[str, float] = {}
    last = reference / f"checkpoint-{args.steps}.pt"
    while process.poll() is None:
        for name, path in (("config", reference / "config.json"), ("trained", last)):
            if name not in marks and path.exists():
                marks[name] = time.perf_counter() - started
        time.sleep(0.02)
    total = time.perf_counter() - started
    if process.returncode:
        raise SystemExit("the uninterrupted run failed")
    startup, trained = marks["config"], marks["trained"] - marks["config"]
    print(
        f"uninterrupted run: {total:.1f} s ({startup:.1f} s start-up, {args.steps} steps in "
        f"{trained:.1f} s, {total - marks['trained']:.1f} s summary and report); one thread"
    )
    run = work / "run"
    command = _command("run", args.steps, args.save_every)
    moments = sorted(rng.uniform(0.0, total) for _ in range(args.kills))
    rows, landed, attempt = [], 0, 0
    while landed < args.kills:
        attempt += 1
        was_finished = (run / "summary.json").exists()
        # The kill moments are points of the uninterrupted run's timeline, drawn at random
        # and sorted: this start is killed at the next one, measured from where its resume
        # point lies on that timeline (a point already behind it: in start-up).
        resumed_at = startup + trained * _newest_step(run) / args.steps
        moment = moments[min(landed, len(moments) - 1)]
        if moment > resumed_at:
            delay = startup + moment - resumed_at
        else:
            delay = rng.uniform(0.0, startup)
        log = work / f"start-{attempt}.txt"
        with log.open("w") as out:  # a file, not a pipe: a full pipe would stall the run
            process = subprocess.Popen(
                command, cwd=work, env=_env(), stdout=out, stderr=subprocess.STDOUT
            )
            try:
                process.wait(timeout=delay)
                killed = False
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
                process.wait()
                killed = True
        output = log.read_text()
        landed += killed
        rows.append(
            (
                attempt,
                f"{delay:5.1f} s" if killed else f"(ended < {delay:.1f} s)",
                _moment(run, args.steps, was_finished) if killed else "-",
                _started(output),
                _on_disk(run) if killed else f"exit {process.returncode}",
            )
        )
    done = subprocess.run(command, cwd=work, env=_env(), capture_output=True, text=True)
    rows.append((attempt + 1, "no kill", "-", _started(done.stdout), f"exit {done.returncode}"))
    print("\n| start | SIGKILL after | the kill came | what the start did | on disk after it |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    same = _same_state(run, reference, args.steps)
    print(
        f"\n{landed} kills, {attempt + 1} starts of the same command; final state "
        f"{'equals' if same else 'DIFFERS FROM'} the uninterrupted run's bitwise"
    )
    return same


def _same_state(run: Path, reference: Path, steps: int) -> bool:
    from memfit.savefile import safe_load

    a = safe_load(run / f"checkpoint-{steps}.pt")
    b = safe_load(reference / f"checkpoint-{steps}.pt")
    a.pop("extra"), b.pop("extra")
    return _equal(a, b)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        bits = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def stall(args: argparse.Namespace, work: Path) -> None:
    import memfit
    from memfit.cli.common import builtin_model, model_config_cls, parse_overrides
    from memfit.savefile import digest

    overrides = parse_overrides(
        [MODEL[i + 1] for i in range(0, len(MODEL), 2)], model_config_cls("gpt")
    )
    model, loss_fn, batch_fn = builtin_model(
        "gpt", overrides, data="synthetic", device=torch.device("cpu"), seed=0
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = memfit.Engine(model, optimizer, precision="fp32", monitor=False, log_every=1000)

    def step(i: int) -> None:
        engine.train_step(batch_fn(8, generator=i), loss_fn)

    for i in range(5):  # warm-up
        step(i)
    step_times, save_times, parts = [], [], {"state_dict": [], "digest": [], "serialize": []}
    path = work / "stall.pt"
    for i in range(args.rounds):
        t = time.perf_counter()
        step(100 + i)
        step_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.save(path)
        save_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        state = engine.state_dict()
        parts["state_dict"].append(time.perf_counter() - t)
        t = time.perf_counter()
        digest(state)
        parts["digest"].append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.save(state, io.BytesIO())
        parts["serialize"].append(time.perf_counter() - t)
    size = path.stat().st_size
    step_ms = 1e3 * statistics.median(step_times)
    save_ms = 1e3 * statistics.median(save_times)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\nstall of a save ({params / 1e6:.2f}M-parameter GPT, fp32, AdamW; state file {size / 2**20:.1f} MiB; medians of {args.rounds}):"
    )
    print("| what | ms |")
    print("|---|---|")
    print(f"| one training step (batch 8 x 64 tokens) | {step_ms:.1f} |")
    print(f"| Engine.save (the step boundary waits for it) | {save_ms:.1f} |")
    for name, times in parts.items():
        print(f"| - of which {name} | {1e3 * statistics.median(times):.1f} |")
    print(
        f"| - of which writing, fsync, rename (the rest) | {save_ms - sum(1e3 * statistics.median(t) for t in parts.values()):.1f} |"
    )
    print(
        f"\none save = {save_ms / step_ms:.2f} steps; at --save-every 100 that is "
        f"{100 * save_ms / (100 * step_ms):.2f}% of training time; at --save-every-minutes 10, "
        f"{100 * save_ms / 1e3 / 600:.4f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--save-every", type=int, default=2, help="often, so that a random kill lands in a save"
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the kill moments")
    parser.add_argument("--rounds", type=int, default=15, help="saves timed for the stall")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="memfit-preemption-"))
    try:
        same = kills(args, work)
        stall(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
