"""Activation storage: a unit's saved tensors kept compressed (bf16, int8, fp8) or off the device.

Keep and recompute are two ways to hold what backward needs; this module adds the third:
keep it, but in fewer bytes. Per unit, through ``torch.autograd.graph.saved_tensors_hooks``
(the same mechanism as ActNN, GACT and COAT's FP8 activations; torchtune and DeepSpeed's
activation offload):

* ``"bf16"``    floating tensors wider than 16 bits stored as bfloat16 (half an fp32
                tensor; a tensor already 16-bit is left as it is).
* ``"int8"``    floating tensors stored as int8 with one fp32 scale per block of
                :data:`INT8_BLOCK` elements (``127 / max|block|``, rounded to nearest):
                a quarter of fp32 and a sixteenth more for the scales. Each block keeps
                its own range, so an outlier costs only its block's precision.
* ``"fp8"``     floating tensors stored as float8 e4m3 with one fp32 scale per tensor
                (``448 / max|t|``): a quarter of fp32, half of bf16.
* ``"offload"`` the tensors copied to host memory (pinned, on a side stream, on CUDA) and
                brought back, all of a unit's at once, when backward first needs one of
                them. On a CPU the host is the device: the same code runs and saves nothing,
                so the planner offers it on CUDA only.

What is compressed. A unit's saved tensors are packed as they are saved but compressed
only when the unit's forward has returned, and only those that nothing else holds: a
tensor the unit received or returned (its neighbours hold it), a parameter, a view another
tensor shares, or a tensor another unit saves too stays as it is, since compressing it
would add a copy rather than remove one. "Nothing else holds" is read from the tensor's
and its storage's reference counts at that moment (no host sync). Tensors under
``min_bytes`` (default 64 KiB), integer and boolean tensors (masks, indices) are not
touched.

Backward decodes a saved tensor each time an op needs it (fp8: ``q.float() / scale``) and
frees the copy with that op's backward: at most one op's inputs are decoded at a time.

Units the plan recomputes are not stored (a checkpoint's own hooks hold their tensors);
a unit between a stored ancestor and its own stored or recomputed children runs its ops
under the nearest enclosing storage, and a unit marked ``"keep"`` inside a stored one is
shielded with identity hooks, so each op's tensors follow the decision of its innermost
unit.

Example::

    handles = apply_storage(model, {"blocks.0": "fp8", "blocks.1": "bf16"})
    loss_fn(model, batch).backward()      # gradients within fp8's rounding of exact
    remove_storage(model)
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from memfit.checkpoint.costs import CODINGS, STORAGES, Storage
from memfit.precision.state_codes import blocks_of

__all__ = [
    "CODINGS",
    "STORAGES",
    "Codable",
    "codable",
    "Storage",
    "apply_storage",
    "compressed_size",
    "remove_storage",
    "stored_units",
]


# Tensors smaller than this stay as they are: a scale, a bias's saved input or a mask row
# costs more to code than it saves.
DEFAULT_MIN_BYTES = 64 * 1024

# float8 e4m3's largest finite value: a tensor's max |x| maps to it.
_E4M3_MAX = 448.0

#: Elements per int8 block, each with its own fp32 scale (4 bytes per 64: a sixteenth).
INT8_BLOCK = 64

_ATTR = "_memfit_storage"


def compressed_size(storage: str, nbytes: float, element_size: int) -> float:
    """Bytes ``nbytes`` of ``element_size``-byte floats take under ``storage`` on the device.

    Example::

        compressed_size("fp8", 4096, 4)    # 1024.0
        compressed_size("int8", 4096, 4)   # 1088.0: a quarter and the blocks' scales
        compressed_size("bf16", 4096, 2)   # 4096.0: already 16-bit
    """
    if storage == "bf16":
        return nbytes * 2 / element_size if element_size > 2 else nbytes
    if storage == "fp8":
        return nbytes / element_size if element_size > 1 else nbytes
    if storage == "int8":
        elements = nbytes / element_size
        return elements * (1 + 4 / INT8_BLOCK) if element_size > 1 else nbytes
    if storage == "offload":
        return 0.0
    return nbytes


class _Held:
    """One saved tensor, as packed: the tensor until the unit's forward ends, then its code."""

    __slots__ = (
        "tensor",
        "code",
        "scale",
        "shape",
        "dtype",
        "device",
        "back",
        "event",
        "group",
        "used",
        "__weakref__",
    )

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.code: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.device = tensor.device
        # Offload: the copy on its way back to the device, the event that says it is there,
        # and the unit call's other tensors (brought back with it).
        self.back: torch.Tensor | None = None
        self.event: Any = None
        # Weak references: a strong one would make a cycle, freed only by the garbage
        # collector, not when the graph goes.
        self.group: list[weakref.ref[_Held]] | None = None
        # Offload: backward has had it once (a second ask brings it back alone).
        self.used = False


class _Counts(NamedTuple):
    """Reference counts of one storage's packed tensors and of their bases, as
    :func:`_counts` reads them."""

    alone_possible: bool
    """False where a base is a parameter (a weight's transpose): never coded."""
    tensors: list[tuple[int, int, int]]
    """Per packed tensor: Python references, C++ uses, views of it among the packed."""
    bases: list[tuple[int, int, int]]
    """The same for each base of a packed view that is not packed itself."""
    storage_users: int
    """Tensors sharing the memory, and the handle read here (-1: unreadable)."""


def _counts(group: list[_Held]) -> _Counts:
    tensors = [h.tensor for h in group]
    bases: dict[int, torch.Tensor] = {}
    views_of: dict[int, int] = {}
    for t in tensors:
        b = t._base  # type: ignore[union-attr]
        if b is not None:
            views_of[id(b)] = views_of.get(id(b), 0) + 1
            if isinstance(b, nn.Parameter):
                return _Counts(False, [], [], -1)
            if not any(b is u for u in tensors):
                bases[id(b)] = b
    # The loop's names would count as holders below.
    t = b = None  # type: ignore[assignment]
    counted = [
        (sys.getrefcount(t), t._use_count(), views_of.get(id(t), 0))  # type: ignore[union-attr]
        for t in tensors
    ]
    counted_bases = [(sys.getrefcount(b), b._use_count(), views_of[id(b)]) for b in bases.values()]
    try:
        users = torch._C._storage_Use_Count(tensors[0].untyped_storage()._cdata)  # type: ignore[union-attr]
    except (RuntimeError, NotImplementedError, AttributeError):
        users = -1
    return _Counts(True, counted, counted_bases, users)


def _baseline() -> tuple[int, int]:
    """The Python references :func:`_counts` reads of a packed tensor nothing else holds,
    and of a base only its packed view holds: measured on fresh tensors, so the rule
    does not depend on how an interpreter counts its own frames' references. Made where
    the tensors being coded are: under a fake tensor mode (the estimator's meta steps)
    fresh tensors are fakes, which hold references of their own."""
    alone = _counts([_Held(torch.empty(4))])
    viewed = _counts([_Held(torch.empty(4).view(2, 2))])
    refs, uses, views = viewed.bases[0]
    return _Baseline(alone.tensors[0][0], refs, uses - 1 - views)


class _Baseline(NamedTuple):
    """What :func:`_counts` reads of fresh tensors nothing else holds."""

    tensor_refs: int
    """Python references of a packed tensor."""
    base_refs: int
    """Python references of a base only its packed view holds."""
    base_extra_uses: int
    """C++ uses of that base beyond its own and its view's (a fake tensor's mode holds one)."""


# Per kind of tensor (plain, fake): the baseline of :func:`_alone`.
_BASELINES: dict[type, _Baseline] = {}


def _alone(group: list[_Held]) -> bool:
    """Whether the tensors packed in ``group`` (one storage) are all that hold it.

    Counted, not traced: every other holder of the memory shows in a reference count. A
    tensor the caller holds in Python has more Python references than a packed one nothing
    else holds; one another op saved (or an unhooked view of it) has more C++ uses; a view
    of its storage anywhere else makes the storage's count higher; a view's base that
    someone holds shows the same way. A wrong "no" only leaves a tensor uncoded; it never
    changes a result.
    """
    kind = type(group[0].tensor)
    if kind not in _BASELINES:
        _BASELINES[kind] = _baseline()
    tensor_refs, base_refs, base_extra_uses = _BASELINES[kind]
    counts = _counts(group)
    if not counts.alone_possible or counts.storage_users < 0:
        return False
    for refs, uses, views in counts.tensors:
        # Shared with C++ (its views hold it), the tensor's Python object gains one
        # reference of its own.
        if uses > 1 + views or refs > tensor_refs + (uses > 1):
            return False
    for refs, uses, views in counts.bases:
        if uses > 1 + views + base_extra_uses or refs > base_refs:
            return False
    # Every tensor sharing the memory, and the handle read.
    return counts.storage_users <= len(counts.tensors) + len(counts.bases) + 1


@dataclass
class _UnitCall:
    """One running call of a stored unit: its hooks and what they packed."""

    hooks: Any
    held: list[_Held] = field(default_factory=list)
    # The call's packed tensors by id (each alive while packed): a tensor two ops save is
    # packed and coded once.
    by_id: dict[int, _Held] = field(default_factory=dict)


def _without_graph(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a saved tensor is kept: without its ``grad_fn``, which autograd restores
    on unpacking. Kept with it, an op's saved output would hold its own graph through
    autograd's C++ nodes, a cycle the garbage collector cannot see: a forward that never
    reaches backward (an evaluation with gradients on) would never be freed."""
    return t.detach() if t.grad_fn is not None else t


def _to_code(call: _UnitCall) -> list[_Held]:
    """What a call packed that only its packed objects hold, storage by storage."""
    by_storage: dict[int, list[_Held]] = {}
    for held in call.held:
        assert held.tensor is not None
        by_storage.setdefault(held.tensor.untyped_storage()._cdata, []).append(held)
    call.held, call.by_id = [], {}
    return [h for group in by_storage.values() if _alone(group) for h in group]


@dataclass
class _UnitStorage:
    """The hooks one unit runs its forward under, and what they packed in the current call."""

    name: str
    storage: Storage
    min_bytes: int
    side_stream: Any = None
    # The calls running, innermost last (a unit called inside itself has two); None for
    # a call made without gradients, which packs nothing.
    calls: list[_UnitCall | None] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)

    def pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if (
            self.storage == "keep"
            or not t.is_floating_point()
            or isinstance(t, nn.Parameter)
            or t.layout != torch.strided
            or nbytes < self.min_bytes
            or compressed_size(self.storage, nbytes, t.element_size()) >= nbytes
        ):
            return _without_graph(t)
        call = self.calls[-1]
        assert call is not None
        held = call.by_id.get(id(t))
        if held is None:
            held = call.by_id[id(t)] = _Held(t)
            call.held.append(held)
        return held

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Held):
            return packed
        if packed.tensor is not None:
            return packed.tensor
        assert packed.code is not None
        if self.storage == "offload":
            if packed.back is None and not packed.used:
                self.prefetch(packed)
            out, packed.back = packed.back, None
            packed.used = True
            if out is None:
                # A tensor backward asks for again (two ops saved it) comes back alone:
                # bringing its whole call back again would hold every tensor twice.
                return packed.code.to(packed.device, non_blocking=True)
            if packed.event is not None:
                stream = torch.cuda.current_stream(packed.device)
                stream.wait_event(packed.event)
                # Made on the side stream, used and freed on this one: without the record
                # the allocator could hand its memory to the next copy while still read.
                out.record_stream(stream)
                packed.event = None
            return out
        if self.storage == "fp8":
            assert packed.scale is not None
            return (packed.code.to(torch.float32) / packed.scale).to(packed.dtype)
        if self.storage == "int8":
            assert packed.scale is not None
            return int8_decode(packed.code, packed.scale, packed.shape, packed.dtype)
        return packed.code.to(packed.dtype)

    def prefetch(self, first: _Held) -> None:
        """Offload on CUDA: bring back every tensor of the unit's call that ``first`` is
        from, on the side stream, when backward asks for the first of them."""
        if self.side_stream is None or first.device.type != "cuda":
            return
        group = [r() for r in first.group] if first.group is not None else [first]
        with torch.cuda.stream(self.side_stream):
            for held in group:
                if (
                    held is not None
                    and held.code is not None
                    and held.back is None
                    and not held.used
                ):
                    held.back = held.code.to(held.device, non_blocking=True)
                    held.event = torch.cuda.Event()
                    held.event.record(self.side_stream)

    def encode(self, call: _UnitCall) -> None:
        """The unit's forward returned: code what only its saved tensors hold."""
        packed = list(call.held)
        coded = _to_code(call)
        family = [weakref.ref(h) for h in coded]
        for held in coded:
            assert held.tensor is not None
            # A code made with gradients on would hold the tensor's graph, which holds the
            # code: a cycle the garbage collector cannot see (see _without_graph).
            t = held.tensor.detach()
            if self.storage == "bf16":
                held.code = t.to(torch.bfloat16)
            elif self.storage == "fp8":
                amax = t.abs().amax().to(torch.float32)
                # No host sync: an all-zero or non-finite tensor gets scale 1 (non-finite
                # values come back NaN, which the loss scaler's overflow check sees).
                ok = torch.isfinite(amax) & (amax > 0)
                held.scale = torch.where(ok, _E4M3_MAX / amax, torch.ones_like(amax))
                held.code = (t.to(torch.float32) * held.scale).to(torch.float8_e4m3fn)
            elif self.storage == "int8":
                held.code, held.scale = int8_encode(t)
            else:
                held.code = self._to_host(t)
                held.group = family
            held.tensor = None
            del t
        for held in packed:  # the uncoded, held as they are
            if held.tensor is not None:
                held.tensor = _without_graph(held.tensor)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.to("cpu", copy=True)
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        # The copy runs beside compute; the tensor must outlive it on the side stream.
        self.side_stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.side_stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.side_stream)
        return host


def int8_encode(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as int8 codes in blocks of :data:`INT8_BLOCK` elements (its flat order; the
    last block padded with zeros) and each block's scale, ``127 / max|block|`` (1 for an
    all-zero block; a non-finite block's codes come back NaN), rounded to nearest, but
    never from a non-zero value to 0: zeros and signs come back as they were. No host sync.

    >>> codes, scales = int8_encode(torch.tensor([0.5, -1.0, 0.25]))
    >>> codes.shape, scales.shape
    (torch.Size([1, 64]), torch.Size([1, 1]))
    >>> int8_decode(codes, scales, torch.Size([3]), torch.float32)
    tensor([ 0.5039, -1.0000,  0.2520])
    """
    blocks = blocks_of(t, INT8_BLOCK)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    ok = torch.isfinite(amax) & (amax > 0)
    scales = torch.where(ok, 127.0 / amax, torch.ones_like(amax))
    codes = (blocks * scales).round_().clamp_(-127, 127)
    # A value that rounds to 0 but is not 0 keeps its sign (one level): what backward reads
    # off a saved output's sign (ReLU's mask from its result) stays exact.
    codes = torch.where((codes == 0) & (blocks != 0), blocks.sign(), codes)
    # A non-finite block: its codes say so (NaN cannot be an int8, so the scale carries it).
    scales = torch.where(torch.isfinite(amax), scales, torch.full_like(amax, float("nan")))
    return codes.to(torch.int8), scales


def int8_decode(
    codes: torch.Tensor, scales: torch.Tensor, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """The tensor :func:`int8_encode` coded, in ``shape`` and ``dtype``."""
    flat = (codes.to(torch.float32) / scales).view(-1)
    return flat[: shape.numel()].view(shape).to(dtype)


@dataclass
class Codable:
    """What a unit's storage would code in one forward, measured (:func:`codable`)."""

    bytes_by_element_size: dict[int, int] = field(default_factory=dict)
    """Bytes of the tensors it would code, by their element size (4: fp32, 2: bf16/fp16)."""
    largest_bytes: int = 0
    """The largest of them: backward decodes one op's tensors at a time."""

    def coded_bytes(self, storage: str) -> float:
        """What those tensors take on the device under ``storage``."""
        return sum(compressed_size(storage, n, e) for e, n in self.bytes_by_element_size.items())

    def total_bytes(self) -> int:
        """What they take as they are."""
        return sum(self.bytes_by_element_size.values())

    def coded_from_bytes(self, storage: str) -> int:
        """Of :meth:`total_bytes`, what ``storage`` codes into fewer bytes (bf16 leaves
        16-bit tensors as they are): the bytes its casts or copies go over."""
        return sum(
            n for e, n in self.bytes_by_element_size.items() if compressed_size(storage, n, e) < n
        )

    def back_bytes(self, storage: str) -> int:
        """What the unit's backward holds decoded at once under ``storage``: one op's
        tensor at a time (the largest), except offloaded ones, all brought back together
        when backward first asks for one (the copy runs ahead of the compute that needs
        it)."""
        return self.total_bytes() if storage == "offload" else self.largest_bytes


class _Probe(_UnitStorage):
    """A unit's storage that codes nothing: it counts what :meth:`encode` would code."""

    found: Codable

    def encode(self, call: _UnitCall) -> None:
        packed = list(call.held)
        for held in _to_code(call):
            t = held.tensor
            assert t is not None
            nbytes = t.numel() * t.element_size()
            sizes = self.found.bytes_by_element_size
            sizes[t.element_size()] = sizes.get(t.element_size(), 0) + nbytes
            self.found.largest_bytes = max(self.found.largest_bytes, nbytes)
            del t
        # The probe's forward has no backward: a packed object holding a tensor whose own
        # graph saved it (an op's output) would be a cycle through autograd's C++ nodes,
        # which the garbage collector cannot see, and the whole graph would never be freed.
        for held in packed:
            held.tensor = None


def codable(
    model: nn.Module, units: list[str], forward: Any, *, min_bytes: int = DEFAULT_MIN_BYTES
) -> dict[str, Codable]:
    """Per unit, what storing it would code, counted on one call of ``forward()`` (the
    model's forward on the example batch, under the training precision): each unit is
    stored alone, with the same rule as in training (:func:`_alone`), and nothing is
    coded. Units must not contain one another, and the model carries no storage of its
    own (the planner measures under :func:`~memfit.checkpoint.suspended`).

    Example::

        codable(model, ["blocks.0", "blocks.1"], lambda: model(x))["blocks.0"].total_bytes()
    """
    modules = dict(model.named_modules())
    probes: dict[str, _Probe] = {}
    for name in units:
        probe = probes[name] = _Probe(name, "fp8", min_bytes)
        probe.found = Codable()
        probe.handles = _hooked(modules[name], probe)
    try:
        out = forward()
        del out
    finally:
        for probe in probes.values():
            for handle in probe.handles:
                handle.remove()
    return {name: probe.found for name, probe in probes.items()}


def _pre(unit: _UnitStorage, module: nn.Module, args: Any, kwargs: Any) -> None:
    if not torch.is_grad_enabled():
        unit.calls.append(None)
        return
    call = _UnitCall(torch.autograd.graph.saved_tensors_hooks(unit.pack, unit.unpack))
    unit.calls.append(call)
    call.hooks.__enter__()


def _post(unit: _UnitStorage, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
    if not unit.calls:
        return
    call = unit.calls.pop()
    if call is None:
        return
    call.hooks.__exit__(None, None, None)
    # Drop our own references to the call's arguments and output before counting who
    # else holds the saved tensors: the caller still holds them, so they stay uncoded.
    del args, kwargs, output
    # What the call packed stays reachable from its graph through the packed objects,
    # not from here.
    unit.encode(call)


def _hooked(module: nn.Module, unit: _UnitStorage) -> list[Any]:
    """``unit``'s hooks on ``module``'s forward: its storage's context around each call."""
    return [
        module.register_forward_pre_hook(lambda m, a, k: _pre(unit, m, a, k), with_kwargs=True),
        module.register_forward_hook(
            lambda m, a, k, o: _post(unit, m, a, k, o), with_kwargs=True, always_call=True
        ),
    ]


def apply_storage(
    model: nn.Module, storage: Mapping[str, str], *, min_bytes: int = DEFAULT_MIN_BYTES
) -> nn.Module:
    """Store the saved tensors of each named unit as ``storage`` says (in place, reversible).

    Example::

        apply_storage(model, {"blocks.0": "fp8"})
        stored_units(model)   # {"blocks.0": "fp8"}
    """
    remove_storage(model)
    modules = dict(model.named_modules())
    for name, kind in storage.items():
        if kind not in STORAGES:
            raise ValueError(
                f"activation storage {kind!r} for unit {name!r} is not one of "
                f"{', '.join(map(repr, STORAGES))}; 'recompute' is a plan decision"
            )
        if name not in modules:
            raise ValueError(
                f"activation storage names unit {name!r}, which the model does not have; "
                "use the names model.named_modules() gives"
            )
    for name, kind in storage.items():
        module = modules[name]
        unit = _UnitStorage(name, kind, min_bytes)  # type: ignore[arg-type]
        unit.handles = _hooked(module, unit)
        setattr(module, _ATTR, unit)
    return model


def stored_units(model: nn.Module) -> dict[str, str]:
    """The storage applied to each unit of ``model`` (empty: none)."""
    return {
        name: unit.storage
        for name, m in model.named_modules()
        if (unit := getattr(m, _ATTR, None)) is not None
    }


def remove_storage(model: nn.Module) -> nn.Module:
    """Take every activation storage off ``model``; its forward is the plain one again."""
    for m in model.modules():
        unit = m.__dict__.pop(_ATTR, None)
        if unit is not None:
            for handle in unit.handles:
                handle.remove()
    return model
