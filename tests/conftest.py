"""Shared test fixtures."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch

# TensorFlow (the Keras tests): quiet, and its CPU allocator counting every tensor. Set
# before any test imports it (tensorboard may import it first, in another test file).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Under an emulated older CPU (ONEDNN_MAX_CPU_ISA, see the Makefile's test-older-cpu),
# TensorFlow's own oneDNN build does not keep to the cap as torch's does: its bf16 kernels
# abort the process. Its Eigen kernels run on any CPU, so the Keras tests use those there.
if os.environ.get("ONEDNN_MAX_CPU_ISA"):
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


@pytest.fixture(scope="session", autouse=True)
def own_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Temporary files of the tests and of the processes they start (torchrun's logs, a
    script's ``mkdtemp``) go under pytest's own directory, which pytest prunes, not into
    the machine's /tmp, where every run would leave them."""
    path = str(tmp_path_factory.mktemp("tmp"))
    saved_env, saved_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = path, path
    yield
    tempfile.tempdir = saved_dir
    if saved_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved_env


@pytest.fixture(autouse=True)
def own_plan_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test keeps the callbacks' plans (``plan_cache="auto"``) in a directory of its
    own: a plan one test made is never read back by another, nor from the user's cache."""
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", str(tmp_path_factory.mktemp("plans")))


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Run a module's tests on one thread: on tiny models, thread start-up and contention
    cost more than the arithmetic. Use with ``pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def op_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The profiler's clock reads the number of aten ops run so far instead of the time:
    a unit's "seconds" become the ops it ran, the same on every machine and under any
    load, so a test of how times are attributed has a verdict that cannot flake."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memfit.checkpoint.profiler import recorder, timing

    class _Counter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            _Counter.ops += 1
            return func(*args, **(kwargs or {}))

    def clock(sync: bool) -> float:
        return float(_Counter.ops)

    monkeypatch.setattr(recorder, "clock", clock)
    monkeypatch.setattr(timing, "clock", clock)
    with _Counter():
        yield


@pytest.fixture
def free_coding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Coding activations counted and measured as free, as if casts took no time: for
    tests of where coded storage fits and what reaches the plan, whose verdict would
    otherwise depend on how fast this CPU casts (fp8 is emulated on some). Whether storing
    pays is tested in test_storage.py with counted costs."""
    from memfit.checkpoint import storage_stage

    monkeypatch.setattr(storage_stage, "COUNTED_PASSES", dict.fromkeys(storage_stage.CODED, 0.0))
    monkeypatch.setattr(
        storage_stage, "coding_rates", lambda storages, *_: dict.fromkeys(storages, 0.0)
    )
