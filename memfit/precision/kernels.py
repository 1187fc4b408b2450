"""Which layer kinds have a 16-bit kernel on this device: probed, not assumed from its name.

CPUs differ: one with AVX-512-BF16 runs a bf16 matmul 2-3x faster than fp32, one with
AVX2 only emulates it at a few percent of fp32's speed, and there oneDNN has no bf16 LSTM
at all (CPU autocast sends ``nn.LSTM`` to bf16, and torch fails with "could not create a
primitive descriptor for the LSTM forward propagation primitive"). So before a model
computes in a 16-bit dtype, each layer kind it uses is run once on a tiny input, forward
and backward under that dtype's autocast, on the device (:func:`kernel_support`, cached
per process, device type and dtype). A kind whose run fails has no kernel: its modules
become fp32 islands (:func:`missing_kernel_types`, which
:func:`~memfit.precision.apply.apply_precision` adds to the policy's own islands), named
in a warning, so training goes on instead of crashing.

A kind that runs but far slower than in fp32 is emulated: that is the matmul probe's to
say (:mod:`memfit.precision.speed`), and ``precision="auto"`` then trains in fp32. Asked
for by hand, an emulated mode is kept (and warned about): it is slow, not wrong.

Tests, and anyone who knows better, inject the answer instead (:func:`assumed_kernels`).

Example::

    support = kernel_support("cpu", torch.bfloat16)
    support.missing()                # ("LSTM",) on an AVX2-only CPU, () on AVX-512-BF16
    with assumed_kernels("cpu", torch.bfloat16, missing=("LSTM",)):
        missing_kernel_types("cpu", torch.bfloat16)   # (nn.LSTM,)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from memfit.errors import ConfigError

__all__ = [
    "KINDS",
    "KernelCheck",
    "KernelKind",
    "KernelSupport",
    "assumed_kernels",
    "kernel_support",
    "missing_kernel_types",
    "kernel_device",
    "module_device",
    "warn_missing",
]


@dataclass(frozen=True)
class KernelKind:
    """One layer kind the probe runs: its family, the module type it islands, a builder."""

    name: str
    """The module type's name (``"LSTM"``)."""
    family: str
    """``"matmul"``, ``"conv"``, ``"rnn"``, ``"attention"`` or ``"norm"``."""
    module_type: type[nn.Module]
    """Modules of this type (and subclasses) become fp32 islands when the kind has no kernel."""
    build: Callable[[], tuple[nn.Module, torch.Tensor]]
    """A tiny module of the kind and an input for it."""


def _linear() -> tuple[nn.Module, torch.Tensor]:
    return nn.Linear(32, 32), torch.randn(4, 32)


def _conv1d() -> tuple[nn.Module, torch.Tensor]:
    return nn.Conv1d(4, 4, 3, padding=1), torch.randn(2, 4, 16)


def _conv2d() -> tuple[nn.Module, torch.Tensor]:
    return nn.Conv2d(4, 4, 3, padding=1), torch.randn(2, 4, 8, 8)


def _conv3d() -> tuple[nn.Module, torch.Tensor]:
    return nn.Conv3d(4, 4, 3, padding=1), torch.randn(1, 4, 4, 4, 4)


def _conv_transpose2d() -> tuple[nn.Module, torch.Tensor]:
    return nn.ConvTranspose2d(4, 4, 3, padding=1), torch.randn(2, 4, 8, 8)


def _rnn(kind: type[nn.RNNBase]) -> Callable[[], tuple[nn.Module, torch.Tensor]]:
    def build() -> tuple[nn.Module, torch.Tensor]:
        return kind(8, 8, batch_first=True), torch.randn(2, 4, 8)

    return build


def _attention() -> tuple[nn.Module, torch.Tensor]:
    return nn.MultiheadAttention(16, 2, batch_first=True), torch.randn(2, 8, 16)


def _layer_norm() -> tuple[nn.Module, torch.Tensor]:
    return nn.LayerNorm(16), torch.randn(4, 16)


def _group_norm() -> tuple[nn.Module, torch.Tensor]:
    return nn.GroupNorm(2, 4), torch.randn(2, 4, 8)


def _batch_norm2d() -> tuple[nn.Module, torch.Tensor]:
    return nn.BatchNorm2d(4), torch.randn(2, 4, 8, 8)


#: The kinds probed. Each builds a tiny instance; a subclass of a kind shares its verdict.
KINDS: tuple[KernelKind, ...] = (
    KernelKind("Linear", "matmul", nn.Linear, _linear),
    KernelKind("Conv1d", "conv", nn.Conv1d, _conv1d),
    KernelKind("Conv2d", "conv", nn.Conv2d, _conv2d),
    KernelKind("Conv3d", "conv", nn.Conv3d, _conv3d),
    KernelKind("ConvTranspose2d", "conv", nn.ConvTranspose2d, _conv_transpose2d),
    KernelKind("LSTM", "rnn", nn.LSTM, _rnn(nn.LSTM)),
    KernelKind("GRU", "rnn", nn.GRU, _rnn(nn.GRU)),
    KernelKind("RNN", "rnn", nn.RNN, _rnn(nn.RNN)),
    KernelKind("MultiheadAttention", "attention", nn.MultiheadAttention, _attention),
    KernelKind("LayerNorm", "norm", nn.LayerNorm, _layer_norm),
    KernelKind("GroupNorm", "norm", nn.GroupNorm, _group_norm),
    KernelKind("BatchNorm2d", "norm", nn.BatchNorm2d, _batch_norm2d),
)

_BY_NAME = {k.name: k for k in KINDS}


@dataclass(frozen=True)
class KernelCheck:
    """One kind's verdict: whether its 16-bit forward and backward ran, and why not."""

    kind: str
    family: str
    works: bool
    error: str = ""
    """The first line of the error the run raised (empty when it works)."""


@dataclass
class KernelSupport:
    """Which kinds run in ``dtype`` on a device type; ``measured`` False when injected."""

    device: str
    dtype: torch.dtype
    checks: dict[str, KernelCheck]
    measured: bool = True

    def missing(self) -> tuple[str, ...]:
        """The kinds with no kernel in this dtype (they train as fp32 islands).

        Example::

            kernel_support("cpu", torch.bfloat16).missing()   # ("LSTM",) on AVX2 only
        """
        return tuple(name for name, check in self.checks.items() if not check.works)

    def describe(self) -> str:
        """One line per kind without a kernel, with torch's error."""
        name = _dtype_name(self.dtype)
        return "; ".join(
            f"{c.kind}: no {name} kernel on {self.device} ({c.error})"
            for c in self.checks.values()
            if not c.works
        )


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter or buffer (CPU for one with none).

    Example::

        module_device(model)   # device(type='cpu')
    """
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def kernel_device(module: nn.Module) -> torch.device:
    """The device whose kernels ``module`` runs: its own, or for a module on the meta
    device the one its fake steps stand in for (CUDA where there is one, else the CPU),
    so an estimate of a bf16 LSTM on an AVX2-only CPU runs it as the fp32 island that
    training will.

    Example::

        kernel_device(meta_model)   # device(type='cpu') on a machine without CUDA
    """
    device = module_device(module)
    if device.type == "meta":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _built(kind: KernelKind, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    """The kind's module and input on ``device``, drawn without touching the caller's
    random stream (a probe inside training must not change what dropout draws)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module, x = kind.build()
    return module.to(device), x.to(device)


def _run(kind: KernelKind, device: torch.device, dtype: torch.dtype) -> None:
    """One forward and backward of the kind under ``dtype``'s autocast (fp32 weights, as
    the mixed modes keep them; autocast casts them as training does)."""
    module, x = _built(kind, device)
    x.requires_grad_(True)
    with torch.autocast(device.type, dtype=dtype):
        out = module(x, x, x)[0] if kind.family == "attention" else module(x)
        if isinstance(out, tuple):  # RNNs: (output, state)
            out = out[0]
    out.float().sum().backward()


def _check(kind: KernelKind, device: torch.device, dtype: torch.dtype) -> KernelCheck:
    # Real tensors with autograd, whatever the caller runs under (no_grad, inference mode,
    # a fake-tensor or recording dispatch mode): the probe is not part of the caller's work.
    try:
        with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
            _run(kind, device, dtype)
    except RuntimeError as error:  # oneDNN/cuDNN: no primitive for this dtype here
        text = str(error).strip() or type(error).__name__
        first = text.splitlines()[0].split(". ")[0]  # oneDNN appends a debugging hint
        return KernelCheck(kind.name, kind.family, False, first)
    return KernelCheck(kind.name, kind.family, True)


_CACHE: dict[tuple[str, torch.dtype], KernelSupport] = {}
_ASSUMED: list[KernelSupport] = []
_WARNED: set[tuple[str, torch.dtype, tuple[str, ...]]] = set()


def kernel_support(device: str | torch.device, dtype: torch.dtype) -> KernelSupport:
    """Which kinds of :data:`KINDS` run in ``dtype`` on ``device``'s type: injected
    (:func:`assumed_kernels`), else probed once per process and cached. fp32, and fake
    devices (``meta``), have every kernel.

    Example::

        kernel_support("cpu", torch.bfloat16).missing()   # () on an AVX-512-BF16 CPU
    """
    device = torch.device(device)
    for support in reversed(_ASSUMED):
        if support.device == device.type and support.dtype == dtype:
            return support
    if dtype == torch.float32 or device.type not in ("cpu", "cuda"):
        every = {k.name: KernelCheck(k.name, k.family, True) for k in KINDS}
        return KernelSupport(device.type, dtype, every, measured=False)
    key = (device.type, dtype)
    if key not in _CACHE:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        _CACHE[key] = KernelSupport(
            device.type, dtype, {k.name: _check(k, device, dtype) for k in KINDS}
        )
    return _CACHE[key]


@contextlib.contextmanager
def assumed_kernels(
    device: str, dtype: torch.dtype, missing: Iterable[str] = ()
) -> Iterator[KernelSupport]:
    """Inside the block, :func:`kernel_support` on ``device`` in ``dtype`` says the kinds
    named in ``missing`` (names from :data:`KINDS`: ``"LSTM"``, ``"Conv2d"``) have no
    kernel and the others work, without running anything.

    Example::

        with assumed_kernels("cpu", torch.bfloat16, missing=("LSTM",)):
            engine = memfit.Engine(lstm_model, opt, precision="bf16-mixed")  # LSTM in fp32
    """
    missing = tuple(missing)
    unknown = [m for m in missing if m not in _BY_NAME]
    if unknown:
        raise ConfigError(f"unknown layer kinds {unknown}; known: {sorted(_BY_NAME)}")
    checks = {
        k.name: KernelCheck(k.name, k.family, k.name not in missing, "assumed missing")
        if k.name in missing
        else KernelCheck(k.name, k.family, True)
        for k in KINDS
    }
    support = KernelSupport(torch.device(device).type, dtype, checks, measured=False)
    _ASSUMED.append(support)
    try:
        yield support
    finally:
        _ASSUMED.remove(support)


def missing_kernel_types(
    device: str | torch.device, dtype: torch.dtype
) -> tuple[type[nn.Module], ...]:
    """The module types with no ``dtype`` kernel on ``device`` (fp32 islands there).

    Example::

        missing_kernel_types("cpu", torch.bfloat16)   # (nn.LSTM,) on an AVX2-only CPU
    """
    return tuple(_BY_NAME[name].module_type for name in kernel_support(device, dtype).missing())


def warn_missing(
    names: Iterable[str], device: str | torch.device, dtype: torch.dtype, mode: str
) -> None:
    """Warn once per process (every time for injected answers) that the modules ``names``
    train as fp32 islands because their kind has no ``dtype`` kernel on ``device``."""
    names = tuple(names)
    if not names:
        return
    support = kernel_support(device, dtype)
    key = (support.device, dtype, names)
    if support.measured and key in _WARNED:
        return
    _WARNED.add(key)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    warnings.warn(
        f"precision {mode!r}: {support.describe()}; so {shown} train as fp32 islands "
        f"(inputs cast up, autocast off inside), and the rest of the model in "
        f"{_dtype_name(dtype)}. engine.settings.kernel_islands lists them; "
        "precision='auto' measures whether the 16-bit mode is faster here at all",
        UserWarning,
        stacklevel=3,
    )
