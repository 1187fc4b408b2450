"""Recording one profiled step: the module hooks, dispatch mode and saved-tensor hooks that
fill each unit's :class:`Stats`.

The :class:`Recorder` runs in two kinds of step (:func:`~memfit.checkpoint.profiler.
runner.run_step` attaches it): the *instrumented* one (``full=True``), which sees every op
(:class:`OpMode`) and every tensor saved for backward, for bytes, FLOPs, op times and the
flags; and the *timed* ones (``full=False``), which only stamp the time at each unit's
start and end and at each autograd node.
"""

from __future__ import annotations

import weakref
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.checkpoint.profiler.chains import ChainWatch
from memfit.checkpoint.profiler.flops import flop_registry_all
from memfit.checkpoint.profiler.retained import RetainedTracker
from memfit.checkpoint.profiler.stats import Stats, clock
from memfit.checkpoint.profiler.storage import SCALARS, dense, op_tensors, storage_of
from memfit.checkpoint.recompute import MATMUL_OPS, saved_by_selective
from memfit.checkpoint.tree import Unit, UnitTree
from memfit.nested import tensors

__all__ = ["OpMode", "Recorder", "storage_of"]


@dataclass
class _Call:
    name: str
    t0: float = 0.0
    # FLOPs and op time since the last tensor saved for backward inside this call: the
    # tail a rebuild that stops early skips.
    tail_flops: float = 0.0
    tail_op_seconds: float = 0.0
    last_pack: float | None = None  # in the timed step: when it last saved a tensor
    # Bytes its own ops saved since its last child unit began (all of them, for a call
    # with no child units): backward frees them before it reaches any child.
    saved_bytes_after_children: int = 0
    in_versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    # The most the forward ops' storages held at once while it ran (measured steps only).
    peak_live: int = 0
    # How many input ids were made when it began: a storage with a smaller id still alive
    # at its end was alive all through it.
    ids_before: int = 0
    buf_versions: list[tuple[str, nn.Module, str, torch.Tensor, int]] = field(default_factory=list)


class _Op(NamedTuple):
    """What :meth:`Recorder.on_op` needs of an op, looked up once per op."""

    packet: Any
    formula: Callable[..., int] | None  # its FLOP formula, if it has one
    mutable: bool  # whether it writes to an argument
    matmul: bool  # one of MATMUL_OPS


class Recorder:
    """Hooks, a dispatch mode and saved-tensor hooks for one profiled step."""

    def __init__(
        self,
        tree: UnitTree,
        stats: dict[str, Stats],
        *,
        full: bool,
        measured: bool,
        sync: bool,
        flop_rate: float,
        bandwidth: float,
    ) -> None:
        self.tree = tree
        self.stats = stats
        self.full = full  # the instrumented step (bytes, FLOPs, ops) or the timed one
        self.measured = measured
        self.sync = sync
        self.flop_rate = flop_rate
        self.bandwidth = bandwidth
        self.unit_of: dict[int, str] = {id(u.module): u.name for u in tree}
        self.chain_watch = ChainWatch(tree)
        self.chains = self.chain_watch.chains
        self.stack: list[_Call] = []
        self.phase: str | None = None
        self.bwd_owner: str | None = None
        self.markers: list[int] = []
        self.owners: list[str | None] = []
        self.probe: torch.Tensor | None = None  # a plain tensor whose views number nodes
        self.bwd_events: list[tuple[float, str | None]] = []
        self.resident: set[Any] = set()
        self.saved_seen: dict[Any, Any] = {}
        self.saved_by: dict[Any, set[str | None]] = {}  # every unit that saves a storage
        self.saved_owner: dict[Any, str | None] = {}
        # Each live storage a unit received, by key: its id, unique within the step (a
        # finalizer forgets it when the storage is freed, so a reused key gets a new id).
        self.input_ids: dict[Any, int] = {}
        self.input_ids_made = 0
        # Copies of resident tensors (weights) another dtype made in forward (autocast's
        # casts), while they live: their storage key -> the weight's storage key.
        self.cast_of: dict[Any, Any] = {}
        # Matmul outputs while they live (weakly: holding them would keep alive what the
        # step frees), and the units around each.
        self.mm_seen: dict[Any, int] = {}
        self.mm_units: dict[Any, tuple[str, ...]] = {}
        # What units' forward ops make, followed until freed (measured steps only: set by
        # the caller once ``resident`` is known).
        self.retained: RetainedTracker | None = None
        self.retained_bytes: dict[str, int] = {}
        # Per unit, in the order their forwards end: units' inputs alive and unsaved then,
        # by id (:attr:`Profile.end_unsaved_inputs`).
        self.end_unsaved_inputs: dict[str, dict[int, int]] = {}
        self.saved_at: dict[Any, tuple[int, int]] = {}  # each saved storage: (seq, bytes)
        # The head of backward: the loss's and the top units' own ops, before backward
        # reaches any unit below them. What it makes, live at once, at most.
        self.top = _top_chain(tree.root)
        self.in_head = True
        self.head_keys: set[Any] = set()
        self.head_live = [0]
        self.head_peak = 0
        # Everything backward makes, live at once, attributed to the unit whose op runs.
        self.bwd_keys: set[Any] = set()
        self.bwd_live = [0]
        self.bwd_seq = 0  # the sequence number of the autograd node running backward
        # Parameter gradients accumulated so far, each parameter once (grad_accumulated),
        # and the trained parameters' names by id (set by the runner).
        self.grad_live = 0
        self.grads_seen: set[int] = set()
        # Trained parameters' names as backward made the first part of each one's gradient
        # (a tied weight's is held from its last use on): Profile.grad_order.
        self.grad_order: list[str] = []
        self.grads_begun: set[int] = set()
        self.param_names: dict[int, str] = {}
        # Each counted storage's finalizer, by key: an in-place accumulation stops it.
        self.bwd_frees: dict[Any, weakref.finalize] = {}
        self.head_frees: dict[Any, weakref.finalize] = {}
        # True from a node's end to the next node's start: the ops then are the engine's
        # sums of gradients into the next nodes' input buffers.
        self.accumulating = False
        self.probes_this_op = 0
        self.ops: dict[Any, _Op] = {}  # what on_op needs of each op, looked up once a step
        self.alive_of: tuple[str, int] | None = None  # what alive_chain is for
        self.alive_chain: list[tuple[Stats, int]] = []
        # Per unit, what its subtree saved in forward: sequence numbers and running bytes.
        self.save_seqs: dict[str, list[int]] = {u.name: [] for u in tree}
        self.save_bytes: dict[str, list[int]] = {u.name: [] for u in tree}
        self.parent_name: dict[str, str | None] = {tree.root.name: None}
        for unit in tree:
            for child in unit.children:
                self.parent_name[child.name] = unit.name
        self.loss_saved = 0
        self.forward_saved = 0  # what the forward has saved for backward so far
        self.counter = 0
        self.iterated: dict[str, list[bool]] = {}
        self.subtree_buffers: dict[str, list[tuple[nn.Module, str]]] = {}
        if full:
            for unit in tree:
                self.subtree_buffers[unit.name] = [
                    (m, name)
                    for m in unit.module.modules()
                    if not isinstance(m, nn.modules.batchnorm._NormBase)
                    for name in m._buffers
                ]

    # ---- time and sequence numbers

    def now(self) -> float:
        return clock(self.sync)

    def sequence_now(self) -> int:
        """The sequence number the next autograd node will get (a probe node's)."""
        # The probe is a plain tensor and runs outside the Python dispatch modes (the
        # recorder's and a fake mode's): a view of it is then a few microseconds, not a
        # dispatched op, and it takes a number all the same.
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS), torch.enable_grad():
            if self.probe is None:
                self.probe = torch.zeros((), requires_grad=True)
            node = self.probe.view_as(self.probe).grad_fn
        # No node under inference mode: nothing there goes to backward anyway.
        return node._sequence_nr() if node is not None else (self.markers or [0])[-1]

    def mark(self, owner: str | None) -> None:
        # The sequence number of a fresh autograd node: every node created after this
        # point belongs to ``owner`` until the next mark.
        self.markers.append(self.sequence_now())
        self.owners.append(owner)

    def saved_alive(self, name: str) -> int:
        """What unit ``name``'s subtree saved that backward has not reached yet: backward
        runs nodes in reverse forward order, freeing each one's saved tensors."""
        seqs = self.save_seqs[name]
        i = bisect_right(seqs, self.bwd_seq)
        return self.save_bytes[name][i - 1] if i else 0

    def owner(self, seq: int) -> str | None:
        i = bisect_right(self.markers, seq) - 1
        return self.owners[i] if i >= 0 else None

    # ---- module hooks

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = self.unit_of.get(id(module))
        if name is None or self.phase != "fwd":
            return
        st = self.stats[name]
        call = _Call(name)
        if self.full:
            st.call_count += 1
            if st.first_call_order < 0:
                st.first_call_order = self.counter
            self.counter += 1
            received = tensors((args, kwargs))
            call.in_versions = [(t, t._version) for t in received]
            st.input_bytes += self.nonresident_bytes(received)
            for t in received:
                key, nbytes, ref = storage_of(t)
                if key not in self.resident:
                    st.input_storage_bytes[key] = nbytes
                    st.input_storage_ids[self.input_id(key, ref)] = nbytes
            call.buf_versions = [
                (bname, m, bname, buf, buf._version)
                for m, bname in self.subtree_buffers[name]
                if (buf := m._buffers.get(bname)) is not None
            ]
            self.chain_watch.enter(name, args, kwargs)
            call.ids_before = self.input_ids_made
        if self.stack:
            self.stack[-1].saved_bytes_after_children = 0  # a child begins: what came before it
        if self.retained is not None:
            call.peak_live = self.retained.live_bytes
        self.stack.append(call)
        self.mark(name)
        call.t0 = self.now()

    def post_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        name = self.unit_of.get(id(module))
        if name is None or self.phase != "fwd" or not self.stack or self.stack[-1].name != name:
            return
        t1 = self.now()
        call = self.stack.pop()
        st = self.stats[name]
        st.forward_seconds += t1 - call.t0
        self.mark(self.stack[-1].name if self.stack else None)
        if not self.full:
            st.tail_measured_seconds += t1 - (
                call.last_pack if call.last_pack is not None else call.t0
            )
            return
        if any(t._version != v for t, v in call.in_versions):
            st.rule_out_recompute(
                "modifies an input tensor in place, so a recompute would see changed inputs"
            )
        for label, m, bname, buf, version in call.buf_versions:
            if m._buffers.get(bname) is not buf or buf._version != version:
                st.rule_out_recompute(
                    f"updates buffer {type(m).__name__}.{label} in forward, so a recompute "
                    "would see the updated value"
                )
        returned = tensors(output)
        st.output_bytes += self.nonresident_bytes(returned)
        st.saved_bytes_after_children += call.saved_bytes_after_children
        if self.retained is not None:
            unsaved = self.retained.unsaved(self.input_ids, self.saved_seen)
            peak = call.peak_live - self.forward_saved
            if peak > st.forward_peak_bytes:
                st.forward_peak_bytes = peak
                # Alive all through the call: made before it began (a smaller id).
                st.forward_unsaved_inputs = {
                    i: n for i, n in unsaved.items() if i < call.ids_before
                }
            # In the order the units' forwards end (the last call's): the last unit inside
            # the model leaves the loss's part of forward holding these.
            self.end_unsaved_inputs.pop(name, None)
            self.end_unsaved_inputs[name] = unsaved
        st.tail_flops += call.tail_flops
        st.tail_op_seconds += call.tail_op_seconds
        self.chain_watch.exit(name, output)
        self.chain_watch.check_use(returned, self.running(), inside=name)

    # ---- bytes

    def note_cast(self, source: torch.Tensor, copy: torch.Tensor) -> None:
        """Remember ``copy`` as a cast of a resident tensor (a weight autocast casts)."""
        src_key = storage_of(source)[0]
        if src_key not in self.resident or source.dtype == copy.dtype:
            return
        key, _, ref = storage_of(copy)
        if key in self.resident:
            return
        try:
            weakref.finalize(ref, _forget_input, self.cast_of, key, src_key)
        except TypeError:
            return  # nothing to follow the lifetime of: not remembered
        self.cast_of[key] = src_key

    def input_id(self, key: Any, ref: Any) -> int:
        """The id of the live storage ``key`` (``ref`` keeps it alive while called), the
        same for every unit that receives it while it lives."""
        found = self.input_ids.get(key)
        if found is None:
            found = self.input_ids[key] = self.input_ids_made
            self.input_ids_made += 1
            weakref.finalize(ref, _forget_input, self.input_ids, key, found)
        return found

    def nonresident_bytes(self, items: list[torch.Tensor]) -> int:
        seen: set[Any] = set()
        total = 0
        for t in items:
            key, nbytes, _ = storage_of(t)
            if key in self.resident or key in seen:
                continue
            seen.add(key)
            total += nbytes
        return total

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.phase not in ("fwd", "loss"):
            return t
        # A rebuild that stops early stops here if nothing is saved after this (resident
        # tensors count: checkpoint counts every saved tensor).
        for call in self.stack:
            call.tail_flops = call.tail_op_seconds = 0.0
        key, nbytes, ref = storage_of(t)
        if key in self.resident:
            return t
        if self.retained is not None and self.phase == "fwd" and self.stack:
            self.retained.saved(t, key, nbytes)
        self.saved_by.setdefault(key, set()).add(self.stack[-1].name if self.stack else None)
        if key in self.saved_seen:
            return t
        self.saved_seen[key] = ref  # held so that a freed storage's address is not reused
        self.saved_owner[key] = self.stack[-1].name if self.stack else None
        if self.phase == "fwd":
            self.forward_saved += nbytes
        if self.stack:
            self.stats[self.stack[-1].name].saved_bytes_own += nbytes
            source = self.cast_of.get(key)
            if source is not None:
                casts = self.stats[self.stack[-1].name].saved_casts_own
                casts[source] = casts.get(source, 0) + nbytes
            self.stack[-1].saved_bytes_after_children += nbytes
            if self.full:
                # The probe node takes the next number; the saving op's node has the one
                # before this op's first probe (on_op resets the count of its probes).
                seq = self.sequence_now() - 1 - self.probes_this_op
                self.probes_this_op += 1
                self.saved_at[key] = (seq, nbytes)
                for call in self.stack:
                    seqs, running = self.save_seqs[call.name], self.save_bytes[call.name]
                    seqs.append(seq)
                    running.append((running[-1] if running else 0) + nbytes)
        else:
            self.loss_saved += nbytes
        return t

    def pack_time(self, t: torch.Tensor) -> torch.Tensor:
        if self.phase == "fwd":
            now = clock(False)  # tails are timed only where the clock needs no sync (CPU)
            for call in self.stack:
                call.last_pack = now
        return t

    # ---- ops

    def running(self) -> list[str]:
        """The units whose forward is running, outermost first."""
        return [call.name for call in self.stack]

    def on_op(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, seconds: float) -> None:
        # Every op of a step comes here: its tensors are gathered once, for all the checks.
        self.probes_this_op = 0  # its saved tensors are packed after this, as its node is made
        op = self.ops.get(func)
        if op is None:
            packet = func.overloadpacket
            op = self.ops[func] = _Op(
                packet,
                flop_registry_all().get(packet),
                func._schema.is_mutable,
                packet in MATMUL_OPS,
            )
        phase = self.phase
        ins = op_tensors(args, kwargs)
        if isinstance(out, torch.Tensor):
            outs = [out]
        else:  # most are device queries (fake tensors' ``prim.device``): no tensor out
            outs = [] if type(out) in SCALARS else tensors(out)
        if phase == "fwd" and self.full:
            self.chain_watch.check_use(ins, self.running())
            if op.packet is _TO_COPY and len(outs) == 1 and ins:
                self.note_cast(ins[0], outs[0])
        if phase in ("fwd", "loss") and self.mm_units and op.mutable:
            self.check_mutation(func, args, kwargs)
        if phase == "bwd":
            if self.full and self.accumulating and func is _ADD:
                self.accumulated_in_place(args, kwargs, out)
            self.backward_made(outs)
            if self.in_head:
                self.head_made(outs)
        if phase == "fwd":
            unit = self.stack[-1].name if self.stack else None
        elif phase == "bwd":
            unit = self.bwd_owner
        else:
            unit = None
        if unit is None:
            return
        if phase == "fwd" and self.retained is not None:
            self.retained.made(unit, outs)
            live = self.retained.live_bytes
            for call in self.stack:
                if live > call.peak_live:
                    call.peak_live = live
        packet, formula = op.packet, op.formula
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        moved = 0
        for t in ins:
            moved += t.numel() * t.element_size()
        for t in outs:
            moved += t.numel() * t.element_size()
        estimate = max(flops / self.flop_rate, moved / self.bandwidth)
        st = self.stats[unit]
        if phase == "bwd":
            st.estimated_backward_own_seconds += estimate
            if self.full:
                live = self.bwd_live[0]
                for up, alive in self.alive_around(unit):  # the unit and every unit around it
                    if alive + live > up.backward_peak_bytes:
                        up.backward_peak_bytes = alive + live
                    if alive + live - self.grad_live > up.backward_peak_released_bytes:
                        up.backward_peak_released_bytes = alive + live - self.grad_live
            return
        st.forward_flops_own += flops
        st.estimated_forward_own_seconds += estimate
        op_time = seconds if self.measured else estimate
        for call in self.stack:
            call.tail_flops += flops
            call.tail_op_seconds += op_time
        if op.matmul and saved_by_selective(func, args, kwargs):
            st.matmul_op_own_seconds += op_time
            for t in outs:
                key, nbytes, ref = storage_of(t)
                if key not in self.mm_seen and key not in self.resident:
                    try:
                        weakref.finalize(ref, _forget, (self.mm_seen, self.mm_units), key)
                    except TypeError:
                        pass  # no storage to follow: its key stays
                    self.mm_seen[key] = nbytes
                    self.mm_units[key] = tuple(call.name for call in self.stack)
                    st.matmul_output_bytes_own += nbytes
        else:
            st.non_matmul_op_own_seconds += op_time
            st.non_matmul_flops_own += flops
        if kwargs.get("generator") is not None:
            for call in self.stack:
                self.stats[call.name].rule_out_recompute(
                    f"draws random numbers from an explicit torch.Generator ({packet}), "
                    "which checkpoint does not replay"
                )

    def alive_around(self, unit: str) -> list[tuple[Stats, int]]:
        """Each unit from ``unit`` up to the root, with what its subtree saved that backward
        has not reached yet. Fixed while one autograd node runs (its ops share it), so kept
        until the next node starts."""
        if self.alive_of != (unit, self.bwd_seq):
            chain: list[tuple[Stats, int]] = []
            name: str | None = unit
            while name is not None:
                chain.append((self.stats[name], self.saved_alive(name)))
                name = self.parent_name.get(name)
            self.alive_of, self.alive_chain = (unit, self.bwd_seq), chain
        return self.alive_chain

    def check_mutation(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """Selective recompute caches matmul outputs and refuses, in backward, one that
        was changed in place after it was made (``ReLU(inplace=True)`` right after a
        ``Linear`` or a convolution): every unit around such an output cannot be selective."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tensors(value):
                for name in self.mm_units.get(storage_of(t)[0], ()):
                    st = self.stats[name]
                    st.not_selective_reason = st.not_selective_reason or (
                        f"a matmul output made in it is changed in place later "
                        f"({func.overloadpacket}), which selective recompute cannot replay"
                    )

    def backward_made(self, made: list[torch.Tensor]) -> None:
        """Follow the new tensors a backward op makes while they live (``bwd_live``)."""
        if not self.full:
            return
        for t in made:
            key, nbytes, ref = storage_of(t)
            if key in self.bwd_keys or key in self.saved_seen or key in self.resident:
                continue
            try:
                done = weakref.finalize(ref, _head_freed, self.bwd_keys, self.bwd_live, key, nbytes)
            except TypeError:
                continue
            self.bwd_keys.add(key)
            self.bwd_frees[key] = done
            self.bwd_live[0] += nbytes

    def grad_accumulated(self, param: torch.Tensor) -> None:
        """A parameter's gradient is accumulated (its post-accumulate hook): counted in
        ``grad_live`` from then on, and the moment noted in each unit around the one
        running (``release_levels``), for a loop that releases gradients in backward."""
        if id(param) in self.grads_seen or param.grad is None or not self.full:
            return
        self.grads_seen.add(id(param))
        self.grad_live += storage_of(param.grad)[1]
        name = self.param_names.get(id(param))
        if name is None or self.bwd_owner is None:
            return
        level = self.bwd_live[0] - self.grad_live
        for up, alive in self.alive_around(self.bwd_owner):
            up.release_levels[name] = max(up.release_levels.get(name, 0), alive + level)

    def head_made(self, made: list[torch.Tensor]) -> None:
        """Count the new tensors an op of the head of backward makes (gradients, among them
        the top modules' weight gradients) while they live, and keep their peak."""
        for t in made:
            key, nbytes, ref = storage_of(t)
            if key in self.head_keys or key in self.saved_seen or key in self.resident:
                continue  # a view of a gradient counted already, or a forward tensor
            try:
                done = weakref.finalize(
                    ref, _head_freed, self.head_keys, self.head_live, key, nbytes
                )
            except TypeError:
                continue  # nothing to follow the lifetime of: not counted
            self.head_keys.add(key)
            self.head_frees[key] = done
            self.head_live[0] += nbytes
        self.head_peak = max(self.head_peak, self.head_live[0])

    def accumulated_in_place(self, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """The engine sums a tensor's gradients into one buffer in place (``add_``) when it
        holds the buffer's only reference, as in a plain step; the references this dispatch
        mode holds make it add out of place here, which would count a second buffer at
        every sum (a scan loop's full-size gradient, once per step). The sum is counted in
        its buffer's place instead. A buffer a plain step could not add to in place (a
        view, one that is also the other term, a larger storage) stays counted."""
        if len(args) != 2 or kwargs or not isinstance(out, torch.Tensor):
            return
        buffer, other = args
        if not (isinstance(buffer, torch.Tensor) and isinstance(other, torch.Tensor)):
            return
        if torch.is_grad_enabled() or buffer.layout != torch.strided or not dense(buffer):
            return  # create_graph sums out of place; sparse and strided views cannot
        key, nbytes, _ = storage_of(buffer)
        if key == storage_of(other)[0] or nbytes != out.numel() * out.element_size():
            return
        for keys, frees, live in (
            (self.bwd_keys, self.bwd_frees, self.bwd_live),
            (self.head_keys, self.head_frees, self.head_live),
        ):
            done = frees.pop(key, None)
            if done is not None and done.detach() is not None:
                keys.discard(key)
                live[0] -= nbytes

    def note_retained(self, ends: Any) -> None:
        """At the end of forward (the autocast region left): what units' forward ops made
        that is still alive but neither saved for backward nor among ``ends`` (the
        model's output, the loss): ``retained_bytes``, by the unit that made it."""
        if self.retained is None:
            return
        # What the step returned, and what the recorder holds itself, not the model.
        ends_keys = {storage_of(t)[0] for t in [*tensors(ends), *self.chain_watch.held()]}
        self.retained_bytes = self.retained.held(set(self.saved_seen) | ends_keys)
        for key in self.retained.saved_and_held(ends_keys):
            self.unsave(key)

    def unsave(self, key: Any) -> None:
        """Move a saved storage that the model also holds elsewhere from its unit's saved
        bytes to its retained bytes: no plan frees it."""
        owner = self.saved_owner.get(key)
        at = self.saved_at.get(key)
        if owner is None or at is None:
            return
        seq, nbytes = at
        st = self.stats[owner]
        st.saved_bytes_own -= nbytes
        st.saved_bytes_after_children = min(st.saved_bytes_after_children, st.saved_bytes_own)
        self.retained_bytes[owner] = self.retained_bytes.get(owner, 0) + nbytes
        name: str | None = owner
        while name is not None:  # what backward finds alive in the subtree drops with it
            seqs, running = self.save_seqs[name], self.save_bytes[name]
            i = bisect_right(seqs, seq) - 1
            if i >= 0 and seqs[i] == seq:
                for j in range(i, len(running)):
                    running[j] -= nbytes
            name = self.parent_name.get(name)

    # ---- backward

    def hook_graph(self, roots: list[Any]) -> list[Any]:
        handles = []
        seen: set[int] = set()
        keep: list[Any] = []
        todo = [r for r in roots if r is not None]
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            keep.append(node)
            seq = node._sequence_nr()
            if seq < 2**62:  # AccumulateGrad nodes carry UINT64_MAX
                # The leaves whose gradients it makes a part of.
                feeds = [id(n.variable) for n, _ in node.next_functions if hasattr(n, "variable")]
                hook = self._node_hook(self.owner(seq), seq, feeds)
                handles.append(node.register_prehook(hook))
                if self.full:
                    handles.append(node.register_hook(self._node_done))
            todo.extend(n for n, _ in node.next_functions if n is not None)
        return handles

    def _node_done(self, grad_inputs: Any, grad_outputs: Any) -> None:
        # The node has run; the engine now adds its outputs to the next nodes' buffers.
        self.accumulating = True

    def _node_hook(self, owner: str | None, seq: int, feeds: list[int]) -> Callable[[Any], None]:
        def hook(grad_outputs: Any) -> None:
            if self.full:
                self.accumulating = False
                self.bwd_owner = owner
                self.bwd_seq = seq
                up = owner  # backward reaches it and the units around it, if not yet
                while up is not None and self.stats[up].grads_before_backward < 0:
                    self.stats[up].grads_before_backward = len(self.grad_order)
                    self.stats[up].backward_held_at_reach = self.bwd_live[0]
                    up = self.parent_name.get(up)
                for key in feeds:
                    if key not in self.grads_begun and key in self.param_names:
                        self.grads_begun.add(key)
                        self.grad_order.append(self.param_names[key])
                if owner is not None and owner not in self.top:
                    self.in_head = False
            else:
                self.bwd_events.append((self.now(), owner))

        return hook


#: The op the autograd engine sums a tensor's gradients with when it cannot add in place.
_ADD = torch.ops.aten.add.Tensor
_TO_COPY = torch.ops.aten._to_copy  # autocast casts weights with it

#: The dispatch keys of Python modes and subclasses: excluded, ops run as plain ones.
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot
)


def _forget(tables: tuple[dict[Any, Any], ...], key: Any) -> None:
    for table in tables:
        table.pop(key, None)


def _forget_input(ids: dict[Any, int], key: Any, found: int) -> None:
    if ids.get(key) == found:
        del ids[key]


def _head_freed(keys: set[Any], live: list[int], key: Any, nbytes: int) -> None:
    keys.discard(key)
    live[0] -= nbytes


def _top_chain(root: Unit) -> set[str]:
    """The root and its single-child descendants: units around every other unit (a step
    module around the model), whose own ops run at the head of backward."""
    names = {root.name}
    while len(root.children) == 1:
        root = root.children[0]
        names.add(root.name)
    return names


class OpMode(TorchDispatchMode):
    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        rec = self.rec
        if rec.phase is None:
            return func(*args, **kwargs)
        t0 = rec.now() if rec.measured else 0.0
        out = func(*args, **kwargs)
        seconds = rec.now() - t0 if rec.measured else 0.0
        rec.on_op(func, args, kwargs, out, seconds)
        return out
