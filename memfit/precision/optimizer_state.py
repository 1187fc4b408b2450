"""Optimizer state in fewer bits: Adam/AdamW moments and SGD momentum kept in 8 bits or bf16.

With AdamW every precision mode holds 8 bytes of optimizer state per parameter (two fp32
moments), often the largest part of a step's memory. :func:`low_bit_state` makes an
optimizer keep its state smaller, in place (the same object, its param groups, its
learning-rate scheduler):

* ``"8bit"``: blockwise logarithmic 8-bit codes (:mod:`memfit.precision.state_codes`),
  2 bytes a parameter for Adam's two moments plus 8 bytes per block of 256 of scales,
  about 2.03 bytes against 8. Blockwise scaling follows Dettmers et al., "8-bit
  Optimizers via Block-wise Quantization" (2022); the logarithmic code is memfit's own.
* ``"bf16"``: bfloat16 moments, 4 bytes a parameter for Adam.

Each step reads a piece of one parameter's moments as fp32, applies torch's own update
formula to it (the arithmetic of ``torch.optim.AdamW(foreach=False)``, so the first step
is bitwise torch's), and stores them back with stochastic rounding. The random draws (one
per element, shared by its two moments) come from a generator seeded by the step count
and the parameter's position, so a run
resumed from a saved state rounds bitwise as the uninterrupted one did. Pieces are at
most :data:`~memfit.precision.state_codes.CHUNK` elements: the step's temporaries are a
few fp32 copies of one piece (:func:`step_temp_bytes`), whatever the model's size.

The same step trains ``precision="bf16-sr"``'s bf16 weights, which have no fp32 master
(``low_bit_state(..., rounded_weights=True)``, with fp32 state too): each piece of a 16-bit
weight is updated in an fp32 copy and stored back with stochastic rounding
(:func:`~memfit.precision.state_codes.round_weight`), its random bits taken from the
piece's draws; fp32 parameters (the fp32 islands) are updated in place as before.

Where it does not fit: AMSGrad (a third moment), ``capturable``/``differentiable`` modes,
sparse gradients, FSDP2's sharded parameters and optimizers other than Adam, AdamW and
SGD are refused with the reason.

Example::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    low_bit_state(opt, "8bit")        # opt.step() now keeps 8-bit moments
    state_bits(opt)                   # "8bit"
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch

from memfit.errors import ConfigError
from memfit.precision.state_codes import (
    BLOCK,
    bits_of,
    draws,
    empty_like_state,
    is_kept,
    pieces,
    read,
    round_weight,
    write,
)

__all__ = [
    "OPTIMIZER_STATES",
    "can_keep",
    "check_keepable",
    "check_optimizer_state",
    "OptimizerState",
    "low_bit_state",
    "predicted_state_bytes",
    "fp32_state_dict",
    "for_rounded_weights",
    "kept_as",
    "rounds_weights",
    "state_bits",
    "piece_temp_bytes",
    "step_temp_bytes",
]

OptimizerState = Literal["fp32", "bf16", "8bit"]
"""How an optimizer keeps its state: as torch makes it, in bfloat16, or in 8-bit codes."""
OPTIMIZER_STATES: tuple[str, ...] = get_args(OptimizerState)

# The attributes that mark a converted optimizer (its state's bits; whether it rounds
# 16-bit weights), and the names of its moments.
_MARK = "_memfit_state"
_ROUNDS = "_memfit_rounds_weights"
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
_MOMENTS = (*_ADAM_MOMENTS, "momentum_buffer")


def _generator(device: torch.device, step: int, index: int) -> torch.Generator:
    """The rounding's random source for one parameter's step: the same on a resumed run."""
    g = torch.Generator(device=device)
    g.manual_seed((step * 1_000_003 + index) % (2**63 - 1))
    return g


def _draw(g: torch.Generator, numel: int, device: torch.device) -> torch.Tensor:
    """The uniform draws that store a piece of ``numel`` elements (every moment of it)."""
    return torch.rand(draws(numel), generator=g, device=device)


def _dense_grad(p: torch.Tensor, bits: str) -> torch.Tensor:
    """``p``'s gradient, flattened; a sparse one is refused."""
    if p.grad.is_sparse:
        raise ConfigError(
            f"optimizer_state={bits!r} takes dense gradients; a sparse one (an Embedding "
            "with sparse=True) needs optimizer_state='fp32'"
        )
    return p.grad.reshape(-1)


def _flat_param(p: torch.Tensor) -> torch.Tensor:
    """``p`` flattened, as a view that updates it in place."""
    if not p.is_contiguous():
        raise ConfigError(
            "optimizer_state='8bit'/'bf16' updates parameters in place through a flat view; "
            "a non-contiguous parameter cannot give one: make it contiguous, or use "
            "optimizer_state='fp32'"
        )
    return p.view(-1)


def _working(piece: torch.Tensor) -> torch.Tensor:
    """The piece of a parameter an update is computed on: itself when it is fp32 (updated
    in place, torch's arithmetic), an fp32 copy of a 16-bit one (stored back rounded)."""
    return piece if piece.dtype == torch.float32 else piece.float()


def _store(piece: torch.Tensor, weight: torch.Tensor, draw: torch.Tensor) -> None:
    """Put an updated fp32 ``weight`` back into its 16-bit parameter ``piece``, rounded
    stochastically (nothing to do for an fp32 one, updated in place)."""
    if weight is not piece:
        piece.copy_(round_weight(weight, draw))


def _adam_step(opt: torch.optim.Optimizer, bits: str) -> None:
    decoupled = isinstance(opt, torch.optim.AdamW)
    index = 0
    for group in opt.param_groups:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        decoupled_here = decoupled or bool(group.get("decoupled_weight_decay", False))
        for p in group["params"]:
            index += 1
            if p.grad is None:
                continue
            grad, flat = _dense_grad(p, bits), _flat_param(p)
            state = opt.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = empty_like_state(p, bits, signed=True)
                state["exp_avg_sq"] = empty_like_state(p, bits, signed=False)
            state["step"] += 1
            step = int(state["step"].item())  # a CPU tensor, as torch keeps it: no sync
            correction1 = 1 - beta1**step
            root2 = math.sqrt(1 - beta2**step)
            g = _generator(p.device, step, index)
            for start, stop in pieces(p.numel()):
                draw = _draw(g, stop - start, p.device)
                # torch's single-tensor Adam/AdamW on this piece, from fp32 moments.
                piece = flat[start:stop]
                weight = _working(piece)
                grad_piece = grad[start:stop].float()
                if group.get("maximize", False):
                    grad_piece = -grad_piece
                if decay and decoupled_here:
                    weight.mul_(1 - lr * decay)
                elif decay:
                    grad_piece = grad_piece.add(weight, alpha=decay)
                exp_avg = read(state["exp_avg"], bits, start, stop)
                exp_avg_sq = read(state["exp_avg_sq"], bits, start, stop)
                exp_avg.lerp_(grad_piece, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad_piece, grad_piece, value=1 - beta2)
                del grad_piece
                denom = (exp_avg_sq.sqrt() / root2).add_(eps)
                weight.addcdiv_(exp_avg, denom, value=-lr / correction1)
                del denom
                _store(piece, weight, draw)
                write(state["exp_avg"], bits, start, exp_avg, draw)
                write(state["exp_avg_sq"], bits, start, exp_avg_sq, draw)


def _sgd_step(opt: torch.optim.Optimizer, bits: str) -> None:
    index = 0
    for group in opt.param_groups:
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        dampening, nesterov = group["dampening"], group["nesterov"]
        for p in group["params"]:
            index += 1
            if p.grad is None:
                continue
            grad, flat = _dense_grad(p, bits), _flat_param(p)
            # A step count seeds the rounding: momentum's, or a 16-bit weight's alone.
            counted = momentum or p.dtype != torch.float32
            state = opt.state[p] if counted else {}
            first = momentum and "momentum_buffer" not in state
            if counted:
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                if first:
                    state["momentum_buffer"] = empty_like_state(p, bits, signed=True)
                state["step"] += 1
                g = _generator(p.device, int(state["step"].item()), index)
            for start, stop in pieces(p.numel()):
                # torch's single-tensor SGD on this piece.
                piece = flat[start:stop]
                weight = _working(piece)
                draw = _draw(g, stop - start, p.device) if counted else None
                step = grad[start:stop].float()
                if group.get("maximize", False):
                    step = -step
                if decay:
                    step = step.add(weight, alpha=decay)
                if momentum:
                    if first:
                        buf = step.clone()
                    else:
                        buf = read(state["momentum_buffer"], bits, start, stop)
                        buf.mul_(momentum).add_(step, alpha=1 - dampening)
                    step = step.add(buf, alpha=momentum) if nesterov else buf
                    write(state["momentum_buffer"], bits, start, buf, draw)
                weight.add_(step, alpha=-lr)
                if draw is not None:
                    _store(piece, weight, draw)


def _check(optimizer: torch.optim.Optimizer, bits: str, rounded: bool) -> Callable[..., None]:
    """The step function for ``optimizer``'s kind, or a ConfigError saying why none fits."""
    name = type(optimizer).__name__
    # What asked for memfit's step, and what to do instead of it.
    if rounded:
        asked = "precision='bf16-sr'" + (
            f" with optimizer_state={bits!r}" if bits != "fp32" else ""
        )
        instead = "use precision='bf16-master'"
    else:
        asked, instead = f"optimizer_state={bits!r}", "use optimizer_state='fp32'"
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.SGD)):
        raise ConfigError(
            f"{asked} runs memfit's own update of Adam, AdamW and SGD; a {name} is not one "
            f"of them: {instead}, or train with torch.optim.AdamW / Adam / SGD"
        )
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "capturable", "differentiable"):
            if group.get(flag):
                raise ConfigError(
                    f"{asked} does not support {name}({flag}=True) "
                    f"({'a third moment' if flag == 'amsgrad' else 'a graph-captured step'}); "
                    f"make the optimizer with {flag}=False or {instead}"
                )
        if isinstance(group["lr"], torch.Tensor):
            raise ConfigError(
                f"{asked} takes a float learning rate; {name} was given a "
                "tensor lr (for capturable steps): pass a float"
            )
    return _sgd_step if isinstance(optimizer, torch.optim.SGD) else _adam_step


def check_optimizer_state(value: str, also: tuple[str, ...] = ()) -> None:
    """Raise ConfigError for an ``optimizer_state`` that is not one of
    :data:`OPTIMIZER_STATES` (or of ``also``: the callbacks take ``"auto"`` too).

    >>> check_optimizer_state("8bit")
    """
    allowed = (*OPTIMIZER_STATES, *also)
    if value not in allowed:
        raise ConfigError(
            f"optimizer_state must be one of {', '.join(map(repr, allowed))}, got {value!r}"
        )


def check_keepable(
    optimizer: torch.optim.Optimizer,
    bits: str,
    data_parallel: str | None = None,
    rounded_weights: bool = False,
) -> Callable[..., None]:
    """Raise ConfigError where :func:`low_bit_state` cannot make ``optimizer`` keep its
    state in ``bits`` (its kind, its settings, FSDP2's sharded parameters) or, with
    ``rounded_weights``, round its 16-bit weights, without converting it; else return the
    step function it would use.

    Example::

        check_keepable(torch.optim.AdamW(params), "8bit")   # no error
    """
    if rounded_weights:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.is_floating_point() and p.dtype not in (torch.float32, torch.bfloat16):
                    raise ConfigError(
                        f"precision='bf16-sr' rounds bf16 weights; the optimizer holds a "
                        f"{p.dtype} parameter: keep the model in fp32 (the Engine casts it) "
                        "or use precision='bf16-master'"
                    )
    if data_parallel == "fsdp":
        raise ConfigError(
            f"optimizer_state={bits!r} does not take FSDP2's sharded parameters yet; use "
            "optimizer_state='fp32' with fully_shard (its state is sharded over the ranks "
            "already), or data-parallel with DDP"
        )
    return _check(optimizer, bits, rounded_weights)


def can_keep(optimizer: torch.optim.Optimizer, bits: str) -> bool:
    """Whether :func:`low_bit_state` takes ``optimizer`` for ``bits`` (its kind and
    settings), without converting it.

    Example::

        can_keep(torch.optim.RMSprop(params), "8bit")   # False
    """
    try:
        _check(optimizer, bits, False)
    except ConfigError:
        return False
    return True


def low_bit_state(
    optimizer: torch.optim.Optimizer,
    bits: str,
    data_parallel: str | None = None,
    rounded_weights: bool = False,
) -> torch.optim.Optimizer:
    """Make ``optimizer`` (Adam, AdamW or SGD) keep its state in ``bits`` (``"8bit"`` or
    ``"bf16"``; ``"fp32"`` leaves it as it is), in place; returns it. ``data_parallel``:
    the kind of the run (``"ddp"``, ``"fsdp"``), whose FSDP2 sharded parameters this step
    does not take yet. ``rounded_weights``: the parameters are bf16 with no fp32 master
    (``precision="bf16-sr"``): memfit's step runs with fp32 state too, computing each
    update in fp32 and storing the weight back with stochastic rounding (it does so for
    any 16-bit parameter of a converted optimizer).

    State it holds already (a run that trained in fp32) is converted at its next step. A
    learning-rate scheduler made on it before keeps working: its step-order check is kept.
    The state dict holds the codes and scales (``load_state_dict`` of a state saved with
    the same setting resumes bitwise).

    Example::

        opt = low_bit_state(torch.optim.AdamW(model.parameters()), "8bit")
        loss.backward(); opt.step()
        opt.state[p]["exp_avg"]   # {"codes": int8 tensor, "scale": its fp32 bits as int32}
    """
    check_optimizer_state(bits)
    current = state_bits(optimizer)
    if (current, rounds_weights(optimizer)) == (bits, rounded_weights):
        return optimizer
    if current == bits != "fp32" and rounded_weights:
        # Its step already rounds 16-bit weights: it is told it trains bf16-sr's.
        setattr(optimizer, _ROUNDS, True)
        return optimizer
    if current != "fp32" or rounds_weights(optimizer):
        raise ConfigError(
            f"this optimizer keeps its state in {current} already"
            f"{' and rounds 16-bit weights' if rounds_weights(optimizer) else ''}; make a "
            f"fresh optimizer for optimizer_state={bits!r}"
        )
    if bits == "fp32" and not rounded_weights:
        return optimizer
    update = check_keepable(optimizer, bits, data_parallel, rounded_weights)

    @torch.no_grad()
    def step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _convert_fp32_state(self, bits)
        update(self, bits)
        return loss

    bound = types.MethodType(step, optimizer)
    wrapped = optimizer.__dict__.get("step")
    if wrapped is not None and getattr(wrapped, "_wrapped_by_lr_sched", False):
        # A scheduler made on it wrapped its step to learn that it was called (torch
        # checks the order of the two steps): keep telling it.
        def counted(*args: Any, **kwargs: Any) -> Any:
            optimizer._opt_called = True  # type: ignore[attr-defined]
            return bound(*args, **kwargs)

        counted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = counted  # type: ignore[method-assign]
    else:
        optimizer.step = bound  # type: ignore[method-assign]
    # A fused optimizer skips overflowed steps itself; this step does not (the scaler then
    # skips it on the host, as for any other optimizer).
    optimizer._step_supports_amp_scaling = False  # type: ignore[attr-defined]
    _keep_codes_on_load(optimizer)
    setattr(optimizer, _MARK, bits)
    setattr(optimizer, _ROUNDS, rounded_weights)
    return optimizer


def _convert_fp32_state(optimizer: torch.optim.Optimizer, bits: str) -> None:
    """Convert fp32 moments the optimizer held before (or loaded from an fp32 state)."""
    if bits == "fp32":
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, p in enumerate(params, start=1):
        state = optimizer.state.get(p)
        if not state:
            continue
        for name in _MOMENTS:
            value = state.get(name)
            if not isinstance(value, torch.Tensor) or is_kept(value):
                continue
            state.setdefault("step", torch.tensor(0.0))
            g = _generator(p.device, int(state["step"].item()), index)
            kept = empty_like_state(p, bits, signed=name != "exp_avg_sq")
            flat = value.reshape(-1)
            for start, stop in pieces(p.numel()):
                draw = _draw(g, stop - start, p.device)
                write(kept, bits, start, flat[start:stop].float(), draw)
            state[name] = kept


def fp32_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (an optimizer's, saved with ``optimizer_state="8bit"`` or ``"bf16"``)
    with its low-bit moments decoded to tensors of each parameter's dtype (fp32 for
    ``bf16-sr``'s step), for loading into ``optimizer`` when it keeps fp32 state: a run
    resumed without low-bit state goes on from where it was. Anything else is returned as
    it is.

    Example::

        opt.load_state_dict(fp32_state_dict(opt, saved))
    """
    if state_bits(optimizer) != "fp32":
        return state_dict
    params = [p for group in optimizer.param_groups for p in group["params"]]
    decoded: dict[Any, Any] = {}
    for key, entry in state_dict.get("state", {}).items():
        entry = dict(entry)
        for name in _MOMENTS:
            value = entry.get(name)
            if is_kept(value) and isinstance(key, int) and key < len(params):
                p = params[key]
                bits = bits_of(value)
                # bf16-sr's step keeps fp32 moments beside bf16 weights; torch's, the
                # parameter's dtype.
                dtype = torch.float32 if rounds_weights(optimizer) else p.dtype
                out = torch.empty(p.numel(), dtype=dtype, device=p.device)
                for start, stop in pieces(p.numel()):
                    out[start:stop] = read(_on(value, p.device), bits, start, stop)
                entry[name] = out.view(p.shape)
        decoded[key] = entry
    return {**state_dict, "state": decoded}


def _on(value: Any, device: torch.device) -> Any:
    """A kept moment on ``device``."""
    if isinstance(value, dict):
        return {k: v.to(device) for k, v in value.items()}
    return value.to(device)


def _keep_codes_on_load(optimizer: torch.optim.Optimizer) -> None:
    """``load_state_dict`` casts every state tensor of a floating-point parameter to the
    parameter's dtype, codes included (and a bf16 weight's fp32 moments under
    ``bf16-sr``): the kept moments are taken out of the loaded dict before it runs and put
    back, on the parameter's device, after."""
    taken: dict[int, dict[str, Any]] = {}

    def before(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        taken.clear()
        every = rounds_weights(opt)  # fp32 moments of bf16 weights: kept as they are too
        state: dict[Any, Any] = {}
        for key, entry in state_dict.get("state", {}).items():
            kept = {
                n: v
                for n, v in entry.items()
                if n in _MOMENTS and (is_kept(v) or (every and isinstance(v, torch.Tensor)))
            }
            if kept and isinstance(key, int):
                taken[key] = kept
            state[key] = {n: v for n, v in entry.items() if n not in kept}
        return {**state_dict, "state": state}

    def after(opt: torch.optim.Optimizer) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]
        for key, kept in taken.items():
            p = params[key]
            opt.state[p].update({n: _on(v, p.device) for n, v in kept.items()})
        taken.clear()

    optimizer.register_load_state_dict_pre_hook(before)
    optimizer.register_load_state_dict_post_hook(after)


def kept_as(
    optimizer_fn: Callable[[Any], torch.optim.Optimizer | None], optimizer_state: str
) -> Callable[[Any], torch.optim.Optimizer | None]:
    """``optimizer_fn`` (``params -> optimizer``, or None) with each optimizer it makes
    keeping its state as ``optimizer_state`` says, for the estimator and the capacity view.

    Example::

        make = kept_as(torch.optim.AdamW, "8bit")
        state_bits(make(model.parameters()))   # "8bit"
    """
    check_optimizer_state(optimizer_state)
    if optimizer_state == "fp32":
        return optimizer_fn

    def make(params: Any) -> torch.optim.Optimizer | None:
        optimizer = optimizer_fn(params)
        return None if optimizer is None else low_bit_state(optimizer, optimizer_state)

    return make


def for_rounded_weights(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """``optimizer`` (its state kept as it is, in whatever bits) made to train bf16 weights
    without masters (``precision="bf16-sr"``), as the Engine will make it: for the
    estimator and the capacity view, which make the optimizer before the mode is known.

    Example::

        for_rounded_weights(torch.optim.AdamW(params))   # fp32 moments, weights rounded
    """
    if optimizer is None:
        return None
    return low_bit_state(optimizer, state_bits(optimizer), rounded_weights=True)


def state_bits(optimizer: torch.optim.Optimizer | None) -> str:
    """How ``optimizer`` keeps its state: ``"8bit"``, ``"bf16"`` or ``"fp32"`` (as torch makes it)."""
    return getattr(optimizer, _MARK, "fp32") if optimizer is not None else "fp32"


def rounds_weights(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer`` runs memfit's step for bf16 weights without masters
    (``precision="bf16-sr"``), whatever its state's bits.

    Example::

        rounds_weights(torch.optim.AdamW(params))   # False
    """
    return bool(getattr(optimizer, _ROUNDS, False))


def predicted_state_bytes(optimizer: torch.optim.Optimizer) -> int | None:
    """The state a converted ``optimizer`` will hold once every parameter has stepped;
    None for one that keeps torch's own state.

    Example::

        predicted_state_bytes(low_bit_state(torch.optim.AdamW(params), "8bit"))
    """
    bits = state_bits(optimizer)
    if bits == "fp32" and not rounds_weights(optimizer):
        return None
    sgd = isinstance(optimizer, torch.optim.SGD)
    total = 0
    for group in optimizer.param_groups:
        moments = (1 if group.get("momentum") else 0) if sgd else 2
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if bits == "8bit":
                blocks = -(-p.numel() // BLOCK)
                per_moment = blocks * BLOCK + blocks * 4  # padded codes, fp32 scales
            else:
                per_moment = p.numel() * (4 if bits == "fp32" else 2)
            # The step count: every moment's, and a rounded weight's alone.
            counted = moments or p.dtype != torch.float32
            total += moments * per_moment + (4 if counted else 0)
    return total


def step_temp_bytes(optimizer: torch.optim.Optimizer, numel: int | None = None) -> int | None:
    """What a converted ``optimizer``'s step allocates for itself at most, counted: the
    largest of its pieces' (:func:`piece_temp_bytes`, by each parameter's group and width);
    None for one that keeps torch's own state. ``numel``: the step of one tensor of that
    many elements alone (an update applied in backward), by the most any group would
    allocate for it.

    Example::

        step_temp_bytes(low_bit_state(torch.optim.AdamW(params), "8bit"))
    """
    bits = state_bits(optimizer)
    if bits == "fp32" and not rounds_weights(optimizer):
        return None
    sgd = isinstance(optimizer, torch.optim.SGD)
    most = 0
    for group in optimizer.param_groups:
        trained = [p for p in group["params"] if p.requires_grad]
        if not trained:
            continue
        if numel is None:
            tensors = [(p.numel(), p.dtype != torch.float32) for p in trained]
        else:  # one tensor of the group's: its width is the widest's here
            tensors = [(numel, any(p.dtype != torch.float32 for p in trained))]
        for size, rounded in tensors:
            for n in {stop - start for start, stop in pieces(size)}:  # whole pieces, the rest
                most = max(most, piece_temp_bytes(n, group, bits, sgd=sgd, rounded=rounded))
    return most


def piece_temp_bytes(n: int, group: dict[str, Any], bits: str, sgd: bool, rounded: bool) -> int:
    """What the step of one piece of ``n`` elements holds at most beside the parameter,
    its gradient and its state: counted from the step's code, bytes per element of the
    piece (padded to whole blocks), checked against the allocator for every kind of group
    (``tests/test_optimizer_state.py``).

    Adam/AdamW: the draws, the fp32 moments, the denominator while it is made (2 copies),
    then coding a moment back: 29 bytes an element with 8-bit or bf16 moments; 21 with
    fp32 ones, updated in place, where rounding the weight back is the peak. SGD with
    momentum: one moment, 25 (21 in fp32), and 4 more for Nesterov's separate step.
    Without momentum nothing is kept: a 16-bit weight's gradient copy, draws and rounding
    hold 25, an fp32 weight only the gradient's copies that ``maximize`` and weight decay
    make. A 16-bit weight's fp32 copy (``rounded``) adds 4; 8-bit codes add a scale per
    block and, for a piece that is not whole blocks, the padded copy a moment is coded
    from (4).

    Example::

        piece_temp_bytes(1024, opt.param_groups[0], "8bit", sgd=False, rounded=False)  # 29712
    """
    padded = -(-n // BLOCK) * BLOCK
    coded = not sgd or bool(group.get("momentum"))  # a moment is written back
    if not coded:
        per = 25 if rounded else 4 * (bool(group.get("maximize")) + bool(group.get("weight_decay")))
    elif sgd:
        per = (21 if bits == "fp32" else 25) + 4 * bool(group.get("nesterov"))
    else:
        per = 21 if bits == "fp32" else 29
    total = (per + 4 * rounded) * padded
    if coded and bits == "8bit":
        total += 4 * (padded // BLOCK) + (4 * padded if n % BLOCK else 0)
    return total
