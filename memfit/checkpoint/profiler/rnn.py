"""What an LSTM's CPU kernel saves for backward that a step on fake tensors does not see.

On the CPU, ``nn.LSTM`` trains through oneDNN (``aten::mkldnn_rnn_layer``), which saves a
workspace of every time step's gates and states for its backward. A step on fake tensors
(the estimator's, the tuner's search) runs the op's meta kernel, whose workspace is empty,
or PyTorch's Python decomposition of the layer: on a 1-layer LSTM of width 128, batch 16
and 64 steps it saved 1.2 MiB where the real kernel saves 8.8 MiB. The workspace's size is
oneDNN's, so it is measured, not assumed: a real copy of each distinct LSTM configuration
runs forward on two small inputs, once on real tensors and once on fake ones, and the
difference in saved bytes is fitted as ``a + b x batch x steps`` (it depends on their
product). During a fake step on the CPU, a forward hook on each LSTM then saves a fake
buffer of that size beside its output, so the unit holding the LSTM keeps it until its
backward, as the real kernel's workspace is kept.

GRU and plain RNN layers save the same on fake and real tensors (measured), and packed
sequences are left as they are.

Example::

    with lstm_workspaces(model, fake_device="cpu"):
        run_step(...)       # on fake tensors: each LSTM's unit saves its workspace
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.profiler.runner import is_fake
from memfit.precision.apply import is_island

#: The two sizes (batch, steps) a configuration is measured at.
PROBES = ((16, 16), (32, 32))


@dataclass(frozen=True)
class WorkspaceFit:
    """The bytes the real kernel saves beyond the fake step's: ``a + b x batch x steps``."""

    a: float
    b: float

    def bytes(self, rows: int) -> int:
        """For ``rows`` = batch x steps (none below zero)."""
        return max(0, int(self.a + self.b * rows))


_FITS: dict[tuple[Any, ...], WorkspaceFit | None] = {}


def _config(lstm: nn.LSTM) -> tuple[Any, ...]:
    """What the kernel's workspace depends on. An fp32 island (an LSTM without a 16-bit
    kernel here, :func:`memfit.precision.apply.apply_precision`) runs in fp32 without
    autocast, whatever the step around it does."""
    island = is_island(lstm)
    return (
        lstm.input_size,
        lstm.hidden_size,
        lstm.num_layers,
        lstm.bias,
        lstm.bidirectional,
        lstm.proj_size,
        torch.float32 if island else next(iter(lstm.parameters())).dtype,
        not island and torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )


def _saved_bytes(module: nn.LSTM, x: torch.Tensor) -> int:
    """Bytes of the distinct storages ``module``'s forward on ``x`` saves for backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[id(storage) if t.device.type == "meta" or is_fake(t) else storage.data_ptr()] = (
            storage.nbytes()
        )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def _measure(key: tuple[Any, ...]) -> WorkspaceFit | None:
    """The fit for one configuration, on real CPU tensors; None where it cannot run here
    (a dtype the CPU kernel lacks)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inp, hidden, layers, bias, bidirectional, proj, dtype, autocast, autocast_dtype = key

    def build() -> nn.LSTM:
        return nn.LSTM(
            inp, hidden, layers, bias, batch_first=True, bidirectional=bidirectional,
            proj_size=proj, dtype=dtype,
        )  # fmt: skip

    gaps = []
    try:
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast):
            for n, steps in PROBES:
                real_module = build()
                x = torch.zeros(n, steps, inp, dtype=dtype, requires_grad=True)
                real = _saved_bytes(real_module, x)
                with FakeTensorMode(allow_non_fake_inputs=True):
                    fake_module = build()
                    fx = torch.zeros(n, steps, inp, dtype=dtype, requires_grad=True)
                    fake = _saved_bytes(fake_module, fx)
                gaps.append(real - fake)
    except RuntimeError:
        return None
    (r1, g1), (r2, g2) = ((n * s, g) for (n, s), g in zip(PROBES, gaps))
    b = (g2 - g1) / (r2 - r1)
    return WorkspaceFit(g1 - b * r1, b)


def workspace_fit(lstm: nn.LSTM) -> WorkspaceFit | None:
    """The measured fit for ``lstm``'s configuration (cached per process).

    Example::

        workspace_fit(nn.LSTM(64, 128)).bytes(16 * 64)   # about 7.9 MiB here
    """
    from torch.utils._python_dispatch import _disable_current_modes

    key = _config(lstm)
    if key not in _FITS:
        # Measured outside the step: no fake mode, no recorder counting the probe's ops
        # (its saved tensors go to the probe's own hooks, the innermost).
        with _disable_current_modes():
            _FITS[key] = _measure(key)
    return _FITS[key]


class _Keep(torch.autograd.Function):
    """Passes ``x`` through and saves ``buffer`` until its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(buffer)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _hook(module: nn.LSTM, args: tuple[Any, ...], output: Any) -> Any:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not is_fake(x) or not torch.is_grad_enabled():
        return output  # a packed sequence, a real step, or no backward to keep it for
    fit = workspace_fit(module)
    if fit is None:
        return output
    rows = x.shape[0] * x.shape[1] if x.dim() == 3 else x.shape[0]
    size = fit.bytes(rows)
    if size == 0:
        return output
    out, state = output
    buffer = torch.empty(size, dtype=torch.uint8, device=x.device)
    return _Keep.apply(out, buffer), state


@contextlib.contextmanager
def lstm_workspaces(model: nn.Module, fake_device: str) -> Iterator[None]:
    """During a step on fake tensors standing in for ``fake_device`` ``"cpu"``, each
    ``nn.LSTM`` of ``model`` saves its kernel's measured workspace (module docstring);
    other devices are left alone (a GPU's kernel cannot be measured on the CPU)."""
    handles = []
    if fake_device == "cpu":
        handles = [m.register_forward_hook(_hook) for m in model.modules() if type(m) is nn.LSTM]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
