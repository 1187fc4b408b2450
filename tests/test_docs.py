"""Every example in README.md and docs/*.md runs, at a size that fits CI.

**Which blocks.** Every fenced block of README.md and docs/*.md is one of:

- ```` ```python ````: run (one test per block, id ``FILE:LINE`` of its first line);
- ```` ```sh ```` / ```` ```bash ````: each command line is run (one test per line, id
  ``FILE:LINE``; a trailing ``\\`` joins lines, ``#`` starts a comment);
- ```` ```text ````: not code (output, a directory tree, a table, a usage synopsis).

Any other tag, or none, fails :func:`test_every_block_is_classified`, so a new snippet is
either tested or deliberately marked as not code.

**Markers.** HTML comments (invisible when rendered) on the lines right above a block's
opening fence, one per line:

- ``<!-- docs-test: skip: REASON -->``: the whole block is skipped with REASON;
- ``<!-- docs-test: skip "PREFIX": REASON -->``: the shell lines that start with PREFIX;
- ``<!-- docs-test: ci "OLD" -> "NEW" -->``: a Python block runs with OLD replaced by NEW
  (its size for CI: fewer steps, a smaller model); OLD must occur in the block;
- ``<!-- docs-test: setup NAME -->``: the Python block runs after the setup NAME below
  instead of ``gpt``.

Skips are for what CI cannot do (install packages, use a GPU, start several processes) or
what takes minutes at any size; a marker that matches nothing fails
:func:`test_markers_match`.

**Python blocks** run in this process with ``exec``, each in a fresh namespace (blocks do
not share names; they share their document's working directory, below, so a block may
read what an earlier one wrote), with tracebacks naming the document's own lines. Before each block, one
setup runs in that namespace: it stands for the reader's own model, data and the objects
the text around the block has made (:data:`SETUPS`):

- ``gpt`` (the default)::

      import torch, memfit
      from memfit.models import build_model
      model, loss_fn, batch_fn = build_model(
          "gpt", data="synthetic", n_layer=2, n_embd=32, n_head=2, block_size=16)
      optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
      batch = micro_batch = example_micro_batch = batch_fn(4, generator=0)
      x = batch[:, :-1]                     # the model's input
      dataset = batch_fn(16, generator=1)   # 16 rows: a Dataset of samples

- ``engine``: ``gpt`` plus ``engine = memfit.Engine(model, optimizer, log_dir="runs/a",
  log_every=1)`` trained 3 steps, ``metrics = dict(engine.metrics)``, ``scaler`` (a
  ``memfit.precision.LossScaler``) and ``plan = memfit.plan(model, batch, loss_fn,
  strategy="full")``;
- ``torchrun``: ``gpt`` without ``optimizer`` (built after ``parallelize``), in a
  one-process ``torchrun`` environment (``RANK=0``, ``WORLD_SIZE=1``, ...) with
  ``init_from_env()`` called: a gloo group of one, destroyed after the block;
- ``hf``: a tiny GPT-2 (``transformers``; ``config``) as ``model``, with ``loss_fn``,
  ``batch``, ``val_batches``, ``prompt``, ``optimizer``, an ``engine`` over it that trained
  a step, and a Trainer's ``args`` and ``data``;
- ``keras``: ``x_train``/``y_train`` (1024 rows of 64 features, 10 classes), ``x``/``y``
  (512 of them), ``loss`` and ``build()`` (a small Keras model).

A Python block whose first line is a comment naming a ``.py`` file (``# mypkg/models.py``)
is that file: its test imports it, and every working directory holds it, with the
``MyNet`` it names defined after it (4 blocks of ``Linear(8, 64) → GELU → Linear(64, 8)``
and a ``Linear(8, 1)`` head), so that ``--factory mypkg.models:workload`` lines run.

**Shell lines** run in order, in the working directory of their document (one temporary
directory per document, shared by its blocks: ``memfit train --out runs/big`` then
``memfit report runs/big``); a line run alone first runs the lines above it in its block.
The directory holds ``bench`` (a link to the repository's) and an empty ``docs``, so
``python bench/x.py --plot docs/y.png`` runs as written and writes there.

- ``memfit ...`` runs :func:`memfit.cli.main.main` (the ``memfit`` script's entry point) in
  this process, which saves the 2-3 s of a fresh interpreter importing torch per line;
- ``python ...`` runs with this interpreter; anything else runs in ``bash``.

**CI size, same flags.** A line keeps every flag it has; the test appends the overrides of
:data:`CLI_SIZE` / :data:`BENCH_SIZE` for its command (argparse: a later flag wins; a later
``--set KEY=`` wins): fewer steps, a smaller model, fewer timed rounds. Lines that name a
``--factory`` or ``--hf-config`` model keep their model. The budgets stay as written.

Each test has a timeout guard (:data:`TIMEOUT_S`). The file runs in about 2.5 minutes
on a busy 2-core CPU; the tests that take more than a few seconds (:data:`SLOW`) are
marked ``slow``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import memfit

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_TAGS = {"python"}
SHELL_TAGS = {"sh", "bash"}
TEXT_TAGS = {"text"}
TIMEOUT_S = 300
"""A hang guard per test, not a speed target."""

_GPT_TINY = ["n_layer=2", "n_embd=32", "n_head=2", "block_size=16"]
_MODEL_SETS = {"gpt": _GPT_TINY, "resnet": ["widths=8,16", "blocks_per_stage=1,1"]}

CLI_SIZE: dict[str, list[str]] = {
    # --steps 2 trains past the first log and eval; --eval-batches 1 keeps evaluation short.
    "train": ["--steps", "2", "--eval-batches", "1"],
    # --resume and a directory that holds a run take only these (their settings are saved).
    "train --resume": ["--steps", "3", "--eval-batches", "1"],
    "plan": [],
    "estimate": [],
    # One timed round of one candidate; the search itself is unchanged.
    "tune": ["--measure-top", "1", "--steps", "1", "--max-seconds", "20"],
    "report": [],
}
"""Flags appended to a ``memfit SUBCOMMAND`` line, and to every line that builds a built-in
model (not ``--factory`` or ``--hf-config``): ``--set`` of :data:`_MODEL_SETS` for its
``--model``. ``estimate --scale`` also gets ``--sizes 2x64,4x128``."""

_BENCH_GPT = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16"]
BENCH_SIZE: dict[str, list[str]] = {
    "bench/precision.py": [*_BENCH_GPT, "--batch-size", "4", "--rounds", "1"],
    "bench/checkpoint.py": [*_BENCH_GPT, "--batch-size", "4", "--rounds", "1", "--budgets", "1"],
    "bench/convergence.py": [
        *_BENCH_GPT,
        *("--batch-size", "4", "--steps", "2", "--fp16-steps", "2", "--eval-batches", "1"),
    ],
    "bench/monitoring.py": [*_BENCH_GPT, "--batch-size", "4", "--windows", "1", "--log-every", "2"],
}
"""Flags appended to a ``python bench/SCRIPT.py`` line: the same shape, smaller."""

SETUPS: dict[str, str] = {
    "gpt": """
        import torch
        import memfit
        from memfit.models import build_model
        torch.manual_seed(0)
        model, loss_fn, batch_fn = build_model(
            "gpt", data="synthetic", n_layer=2, n_embd=32, n_head=2, block_size=16
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = micro_batch = example_micro_batch = batch_fn(4, generator=0)
        x = batch[:, :-1]  # the model's input (a batch holds the targets' extra token)
        dataset = batch_fn(16, generator=1)
    """,
    "hf": """
        import torch
        import memfit
        from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=32)
        model = GPT2LMHeadModel(config)
        def loss_fn(model, batch):
            return model(input_ids=batch, labels=batch).loss
        batch = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
        val_batches = [batch[:2], batch[2:]]
        prompt = batch[:1, :4]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = memfit.Engine(model, optimizer)
        engine.train_step(batch, loss_fn)
        data = [{"input_ids": row, "labels": row} for row in batch]
        args = TrainingArguments(
            output_dir="runs/hf", max_steps=1, report_to=[], save_strategy="no", use_cpu=True
        )
    """,
    "keras": """
        import numpy as np
        import keras
        rng = np.random.default_rng(0)
        x_train = rng.standard_normal((1024, 64)).astype("float32")
        y_train = rng.integers(0, 10, 1024)
        x, y = x_train[:512], y_train[:512]
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        def build():
            inputs = keras.Input((64,))
            h = inputs
            for _ in range(3):
                h = keras.layers.Dense(64, activation="gelu")(h)
            return keras.Model(inputs, keras.layers.Dense(10)(h))
    """,
}
SETUPS["engine"] = (
    SETUPS["gpt"]
    + """
        from memfit.precision import LossScaler
        engine = memfit.Engine(model, optimizer, log_dir="runs/a", log_every=1)
        for step in range(3):
            engine.train_step(batch_fn(4, generator=step), loss_fn)
        metrics = dict(engine.metrics)
        scaler = LossScaler()
        plan = memfit.plan(model, batch, loss_fn, strategy="full")
    """
)
SETUPS["torchrun"] = (
    SETUPS["gpt"]
    + """
        del optimizer  # under data parallel, built after parallelize
        from memfit.distributed import init_from_env
        init_from_env()
    """
)
SETUP_ENV: dict[str, dict[str, str]] = {
    # torchrun's environment for one process: init_from_env() makes a gloo group of one.
    "torchrun": {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
    }
}

MYNET = """

class MyNet(torch.nn.Module):  # the test's stand-in for the reader's model
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(
            *[
                torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
                for _ in range(4)
            ]
        )
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.blocks(x))
"""


# --- the documents' blocks ------------------------------------------------------------------


@dataclass
class Block:
    doc: str  # path relative to the repository root
    line: int  # 1-based line of the block's first content line
    tag: str
    lines: list[str]
    skip: str | None = None  # the whole block's skip reason
    skip_lines: dict[str, str] = field(default_factory=dict)  # prefix -> reason
    ci: list[tuple[str, str]] = field(default_factory=list)
    setup: str = "gpt"
    bad_markers: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    @property
    def file_name(self) -> str | None:
        """The file a Python block is (its first line ``# path/to/file.py``), or None."""
        m = re.fullmatch(r"#\s*([\w./-]+\.py)\s*", self.lines[0]) if self.lines else None
        return m.group(1) if m else None


_FENCE = re.compile(r"^(\s*)```(.*)$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")


def _apply_marker(block: Block, text: str) -> None:
    if m := re.fullmatch(r'skip\s+"([^"]+)":\s*(.+)', text):
        block.skip_lines[m.group(1)] = m.group(2)
    elif m := re.fullmatch(r"skip:\s*(.+)", text):
        block.skip = m.group(1)
    elif m := re.fullmatch(r'ci\s+"((?:[^"\\]|\\.)*)"\s*->\s*"((?:[^"\\]|\\.)*)"', text):
        unescape = lambda s: s.replace('\\"', '"')  # noqa: E731
        block.ci.append((unescape(m.group(1)), unescape(m.group(2))))
    elif (m := re.fullmatch(r"setup\s+(\w+)", text)) and m.group(1) in SETUPS:
        block.setup = m.group(1)
    else:
        block.bad_markers.append(text)


def parse_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, with the markers above each."""
    doc = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, tag = m.group(1), m.group(2).strip()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]]
        block = Block(doc=doc, line=i + 2, tag=tag, lines=body)
        j = i - 1
        markers = []
        while j >= 0 and (mm := _MARKER.match(lines[j])):
            markers.append(mm.group(1))
            j -= 1
        for text in reversed(markers):
            _apply_marker(block, text)
        blocks.append(block)
        i = end + 1
    return blocks


BLOCKS = [b for path in DOC_FILES for b in parse_blocks(path)]


@dataclass
class ShellLine:
    block: Block
    line: int  # 1-based line in the document
    command: str  # continuation lines joined, comment removed
    index: int  # position among the block's commands

    @property
    def id(self) -> str:
        return f"{self.block.doc}:{self.line}"

    def skip_reason(self) -> str | None:
        if self.block.skip:
            return self.block.skip
        for prefix, reason in self.block.skip_lines.items():
            if self.command.startswith(prefix):
                return reason
        return None


def shell_lines(block: Block) -> list[ShellLine]:
    out: list[ShellLine] = []
    pending: list[str] = []
    start = 0
    for k, raw in enumerate(block.lines):
        if not pending:
            start = block.line + k
        stripped = raw.rstrip()
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(stripped)
        words = shlex.split(" ".join(pending), comments=True)
        pending = []
        if words:
            out.append(ShellLine(block, start, shlex.join(words), len(out)))
    return out


SLOW = (
    "memfit tune",
    "--tune",
    "--nproc",
    "--scale",
    "python bench/",
    "memfit.tune(",
    "import lightning",
)
"""Text that makes a test take more than a few seconds (``pytest.mark.slow``): the tuner's
search, several processes, the capacity view, benchmarks, Lightning's Trainer."""


def _param(item: Block | ShellLine, text: str) -> object:
    marks = [pytest.mark.slow] if any(s in text for s in SLOW) else []
    return pytest.param(item, id=item.id, marks=marks)


PYTHON_BLOCKS = [b for b in BLOCKS if b.tag in PYTHON_TAGS]
SHELL_LINES = [ln for b in BLOCKS if b.tag in SHELL_TAGS for ln in shell_lines(b)]
FILE_BLOCKS = {b.file_name: b for b in PYTHON_BLOCKS if b.file_name}


def test_every_block_is_classified() -> None:
    """A block is tested (python, sh, bash) or marked as not code (text): none slips by."""
    known = PYTHON_TAGS | SHELL_TAGS | TEXT_TAGS
    loose = [f"{b.id} (```{b.tag})" for b in BLOCKS if b.tag not in known]
    assert not loose, (
        "fenced blocks that are neither run nor marked as not code; tag each ```python, "
        "```sh or ```bash (tested) or ```text (output, trees, tables): " + ", ".join(loose)
    )
    assert len(PYTHON_BLOCKS) + len(SHELL_LINES) > 0


def test_markers_match() -> None:
    """Every marker is understood and matches something in its block."""
    problems = []
    for b in BLOCKS:
        problems += [f"{b.id}: unknown marker {text!r}" for text in b.bad_markers]
        if (b.skip_lines or b.ci or b.setup != "gpt") and b.tag not in PYTHON_TAGS | SHELL_TAGS:
            problems.append(f"{b.id}: markers on a block that is not run")
        commands = [ln.command for ln in shell_lines(b)] if b.tag in SHELL_TAGS else []
        for prefix in b.skip_lines:
            if not any(c.startswith(prefix) for c in commands):
                problems.append(f"{b.id}: skip {prefix!r} matches no line")
        for old, _ in b.ci:
            if old not in b.text:
                problems.append(f"{b.id}: ci {old!r} is not in the block")
    assert not problems, "\n".join(problems)


# --- running ---------------------------------------------------------------------------------


@contextlib.contextmanager
def working_dir(path: Path) -> Iterator[None]:
    """``contextlib.chdir`` (Python 3.11) for 3.10."""
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def time_limit(seconds: int, what: str) -> Iterator[None]:
    """Raise TimeoutError in this (main) thread after ``seconds``."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"{what}: still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One working directory per document, made on first use."""
    return {}


def workdir_for(doc: str, workdirs: dict[str, Path], factory: pytest.TempPathFactory) -> Path:
    if doc not in workdirs:
        d = factory.mktemp(re.sub(r"\W", "_", doc))
        (d / "bench").symlink_to(ROOT / "bench", target_is_directory=True)
        (d / "docs").mkdir()
        for name, block in FILE_BLOCKS.items():
            target = d / name
            target.parent.mkdir(parents=True, exist_ok=True)
            for parent in target.relative_to(d).parents:
                if parent != Path(".") and not (d / parent / "__init__.py").exists():
                    (d / parent / "__init__.py").write_text("")
            target.write_text(block.text + MYNET)
        workdirs[doc] = d
    return workdirs[doc]


def run_python(block: Block, cwd: Path) -> None:
    src = block.text
    for old, new in block.ci:
        src = src.replace(old, new)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    setup = textwrap.dedent(SETUPS[block.setup])
    saved_env = dict(os.environ)
    os.environ.update(SETUP_ENV.get(block.setup, {}))
    try:
        exec(compile(setup, f"<docs-test setup {block.setup}>", "exec"), namespace)
        # Padded so that a traceback names the document's own line numbers.
        code = compile("\n" * (block.line - 1) + src, block.doc, "exec")
        exec(code, namespace)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def import_file_block(block: Block, cwd: Path) -> None:
    """Import a file block from ``cwd``; a ``workload()`` in it (the ``--factory``
    contract) must return a ``memfit.Workload`` whose loss runs backward on 2 samples."""
    assert block.file_name is not None
    _drop_modules(cwd)
    sys.path.insert(0, str(cwd))
    try:
        module = importlib.import_module(block.file_name[: -len(".py")].replace("/", "."))
    finally:
        sys.path.remove(str(cwd))
    if hasattr(module, "workload"):
        work = module.workload()
        assert isinstance(work, memfit.Workload), type(work)
        work.loss_fn(work.model_fn(), work.batch_fn(2)).backward()


def _drop_modules(cwd: Path) -> None:
    """Forget modules imported from another document's directory (``mypkg``)."""
    for name in list(sys.modules):
        file = getattr(sys.modules[name], "__file__", None) or ""
        if name.split(".")[0] in {p.split("/")[0] for p in FILE_BLOCKS} and not file.startswith(
            str(cwd)
        ):
            del sys.modules[name]


def memfit_argv(words: list[str], cwd: Path) -> list[str]:
    """``memfit ...``'s arguments with the CI overrides appended."""
    argv = list(words[1:])
    if not argv or argv[0].startswith("-"):
        return argv
    command = argv[0]
    resumes = "--resume" in argv or (
        command == "train" and "--out" in argv and (cwd / argv[argv.index("--out") + 1]).is_dir()
    )
    extra = list(CLI_SIZE["train --resume" if command == "train" and resumes else command])
    builds_builtin = not ({"--factory", "--hf-config"} & set(argv)) and command != "report"
    if builds_builtin and not resumes:
        model = argv[argv.index("--model") + 1] if "--model" in argv else "gpt"
        for item in _MODEL_SETS[model]:
            extra += ["--set", item]
    if command == "estimate" and "--scale" in argv:
        extra += ["--sizes", "2x64,4x128"]
    return argv + extra


def run_shell(line: ShellLine, cwd: Path) -> None:
    words = shlex.split(line.command)
    if words[0] == "memfit":
        from memfit.cli.main import main

        _drop_modules(cwd)
        argv = memfit_argv(words, cwd)
        saved_path = list(sys.path)  # --factory puts the current directory on it
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.path[:] = saved_path
        assert code == 0, f"memfit {shlex.join(argv)} exited {code}"
        return
    if words[0] == "python":
        script = words[1] if len(words) > 1 else ""
        argv = [sys.executable, *words[1:], *BENCH_SIZE.get(script, [])]
    else:
        argv = ["bash", "-c", line.command]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{shlex.join(argv)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


_ran: dict[str, BaseException | None] = {}


def run_line_once(
    line: ShellLine, workdirs: dict[str, Path], factory: pytest.TempPathFactory
) -> BaseException | None:
    if line.id in _ran:
        return _ran[line.id]
    cwd = workdir_for(line.block.doc, workdirs, factory)
    error: BaseException | None = None
    try:
        with time_limit(TIMEOUT_S, line.id), working_dir(cwd):
            run_shell(line, cwd)
    except Exception as exc:  # reported by the line's own test
        error = exc
    _ran[line.id] = error
    return error


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("block", [_param(b, b.text) for b in PYTHON_BLOCKS])
def test_python_block(
    block: Block, workdirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    if block.skip:
        pytest.skip(block.skip)
    cwd = workdir_for(block.doc, workdirs, tmp_path_factory)
    with time_limit(TIMEOUT_S, block.id), working_dir(cwd):
        if block.file_name:
            import_file_block(block, cwd)
        else:
            run_python(block, cwd)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("line", [_param(ln, ln.command) for ln in SHELL_LINES])
def test_shell_line(
    line: ShellLine, workdirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    reason = line.skip_reason()
    if reason:
        pytest.skip(reason)
    for earlier in shell_lines(line.block)[: line.index]:  # what it may build on
        if earlier.skip_reason() is None:
            run_line_once(earlier, workdirs, tmp_path_factory)  # its own test reports it
    error = run_line_once(line, workdirs, tmp_path_factory)
    if error is not None:
        raise error
