"""Candidate checkpoint units: the blocks of a model, found in its module tree.

A *unit* is a module the planner may checkpoint on its own. :func:`find_units` picks them:

1. **The model itself** (qualified name ``""``), always the root of the tree.
2. **Chains**: an ``nn.ModuleList`` or ``nn.Sequential`` (or a subclass) that holds blocks.
   The container and every one of its children become units, children in index order, so
   the planner can checkpoint single children or *segments* of consecutive ones. A child
   is a *block* when it holds parameters and either has submodules of its own (a
   Transformer layer, a residual block, a ResNet stage) or is a recurrent layer
   (``nn.RNNBase``). One block is enough: a one-layer model still has a unit to plan.
3. **Deep stacks of plain layers** (``Linear``, ``Conv``, norms, activations with no
   submodules), like VGG's ``features``: a chain when it lies outside every block and has
   at least :data:`MIN_STACK_LAYERS` layers of which two or more hold parameters, or when
   it is the model itself. Shorter stacks (a conv-BN-ReLU stem, a classifier head) and
   stacks inside a block (a Transformer MLP's ``Sequential``) are left to their parent:
   checkpointing a single Linear saves little and costs a kernel launch per layer.
4. **Any module named in** ``extra``.

Containers without parameters are never chains. Chains nest: a ``Sequential`` of stages,
each a ``Sequential`` of residual blocks, makes both the stages and the blocks units.
Hugging Face models are found the same way (GPT-2's ``transformer.h``, BERT's
``encoder.layer``, Llama's ``model.layers`` are ``nn.ModuleList`` s of blocks).

Example::

    tree = find_units(model)                  # e.g. GPT: "", "blocks", "blocks.0", ...
    tree = find_units(model, extra=["head"])  # plus a module of your choice
    structure_fingerprint(model, tree)        # [("", "GPT"), ("blocks", "ModuleList"), ...]
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from memfit.checkpoint.compiled import unwrap_compiled
from memfit.errors import PlanError

__all__ = [
    "MIN_STACK_LAYERS",
    "Unit",
    "UnitTree",
    "find_units",
    "original_class",
    "structure_fingerprint",
    "unit_tree",
]

#: Fewest layers a stack of plain layers needs to be a chain (rule 3 above).
MIN_STACK_LAYERS = 4

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def original_class(module: nn.Module) -> type:
    """The class ``module`` was built as, looking through the class memfit swaps in while a
    plan with segments is applied (:mod:`memfit.checkpoint.apply`).

    Example::

        original_class(model.blocks)  # nn.ModuleList, planned or not
    """
    return type(module).__dict__.get("_memfit_base_class", type(module))


_ITER_CLASSES: dict[tuple[type, Callable[..., Any]], type] = {}


def iter_override_class(cls: type, iter_fn: Callable[..., Any]) -> type:
    """A cached subclass of ``cls`` whose ``__iter__`` is ``iter_fn``, for swapping into a
    container's ``__class__`` (the executor's segments, the profiler's iteration probe).

    It keeps the name, module and docstring, and :func:`original_class` sees through it.
    """
    key = (cls, iter_fn)
    sub = _ITER_CLASSES.get(key)
    if sub is None:
        namespace = {
            "__iter__": iter_fn,
            "_memfit_base_class": cls,
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
        }
        sub = _ITER_CLASSES[key] = type(cls.__name__, (cls,), namespace)
    return sub


@dataclass(eq=False)
class Unit:
    """One candidate unit: a module of the model and the units below it."""

    name: str
    """Qualified module name, ``""`` for the model itself."""
    module: nn.Module
    """The module."""
    children: list[Unit] = field(default_factory=list)
    """Units directly below, in module registration order (index order for a chain)."""
    is_chain: bool = False
    """True for an ``nn.ModuleList`` / ``nn.Sequential`` whose children are all units, in
    index order: the executor can run segments of consecutive children."""

    @property
    def class_name(self) -> str:
        """The module's class name (the class it was built as)."""
        return original_class(self.module).__name__

    def walk(self) -> Iterator[Unit]:
        """This unit and every unit below it, parents before children."""
        yield self
        for child in self.children:
            yield from child.walk()

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {self.class_name}, children={len(self.children)})"


@dataclass(eq=False)
class UnitTree:
    """The candidate units of a model, as a tree rooted at the model.

    Example::

        tree = find_units(model)
        tree.names()          # ["", "blocks", "blocks.0", "blocks.1"]
        tree["blocks.0"].module
    """

    root: Unit
    """The model's unit (name ``""``)."""

    def __post_init__(self) -> None:
        self._by_name = {u.name: u for u in self.root.walk()}

    def __iter__(self) -> Iterator[Unit]:
        return self.root.walk()

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Unit:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a unit of this tree") from None

    def names(self) -> list[str]:
        """Every unit's qualified name, parents before children."""
        return [u.name for u in self.root.walk()]

    def parent(self, name: str) -> Unit | None:
        """The unit directly above ``name`` (None for the root)."""
        for unit in self.root.walk():
            if any(c.name == name for c in unit.children):
                return unit
        return None

    def __repr__(self) -> str:
        lines = []

        def show(unit: Unit, depth: int) -> None:
            tag = " [chain]" if unit.is_chain else ""
            lines.append(f"{'  ' * depth}{unit.name or '<model>'}: {unit.class_name}{tag}")
            for c in unit.children:
                show(c, depth + 1)

        show(self.root, 0)
        return "UnitTree(\n" + "\n".join(lines) + "\n)"


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_block(module: nn.Module) -> bool:
    if not _has_params(module):
        return False
    return isinstance(module, nn.RNNBase) or next(module.children(), None) is not None


def _is_chain(module: nn.Module, inside_block: bool, is_root: bool) -> bool:
    if not isinstance(module, _CONTAINERS) or len(module) == 0:
        return False
    children = list(module.children())
    if any(_is_block(c) for c in children):
        return True
    # A stack of plain layers: only outside blocks, and only when deep (or the model).
    if inside_block or any(next(c.children(), None) is not None for c in children):
        return False
    with_params = sum(_has_params(c) for c in children)
    return with_params >= 2 and (is_root or len(children) >= MIN_STACK_LAYERS)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _module_order(model: nn.Module) -> dict[str, int]:
    order: dict[str, int] = {}
    for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False)):
        order.setdefault(name, i)
    return order


def _lookup(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        close = difflib.get_close_matches(name, names, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise PlanError(
            f"{type(model).__name__} has no submodule named {name!r}.{hint} "
            "Unit names are qualified module names as model.named_modules() lists them."
        ) from None


def unit_tree(model: nn.Module, names: Iterable[str]) -> UnitTree:
    """The tree of exactly the units ``names`` (plus the model itself, ``""``).

    A unit's parent is its nearest named ancestor. A named ``ModuleList`` / ``Sequential``
    all of whose children are named too is a chain (segments allowed).

    Raises:
        PlanError: When a name is not a submodule of ``model``.

    Example::

        tree = unit_tree(model, ["encoder.blocks.0", "encoder.blocks.1"])
    """
    model = unwrap_compiled(model)
    wanted = {""} | {str(n) for n in names}
    modules = {n: _lookup(model, n) for n in wanted}
    order = _module_order(model)
    ordered = sorted(wanted, key=lambda n: (order.get(n, len(order)), n))
    units: dict[str, Unit] = {}
    for name in ordered:
        unit = Unit(name, modules[name])
        units[name] = unit
        if not name:
            continue
        parts = name.split(".")
        parent = ""
        for k in range(len(parts) - 1, 0, -1):
            candidate = ".".join(parts[:k])
            if candidate in units:
                parent = candidate
                break
        units[parent].children.append(unit)
    for unit in units.values():
        mod = unit.module
        if isinstance(mod, _CONTAINERS) and len(mod) > 0:
            child_names = [_join(unit.name, n) for n, _ in mod.named_children()]
            if [c.name for c in unit.children] == child_names:
                unit.is_chain = True
    return UnitTree(units[""])


def find_units(model: nn.Module, extra: Iterable[str] | None = None) -> UnitTree:
    """Find the candidate checkpoint units of ``model`` (rules in the module docstring);
    public as ``memfit.checkpoint.find_units``.

    Returns:
        A :class:`UnitTree` rooted at the model (``""``): ``.names()`` lists the units'
        qualified names, parents before children; ``tree[name].module`` is the module.
        For a model whose blocks it cannot find, name them: ``Engine(..., units=[...])``.

    Args:
        model: The model.
        extra: Qualified names of further modules to make units, e.g. ``["encoder"]``.

    Raises:
        PlanError: When the model has no detectable blocks and ``extra`` names none; the
            message says how to name units. Also for a name in ``extra`` that is not a
            submodule.

    Example::

        find_units(GPT(GPTConfig(n_layer=2))).names()
        # ['', 'blocks', 'blocks.0', 'blocks.1']
    """
    model = unwrap_compiled(model)  # names are the model's own, without "_orig_mod."
    names: set[str] = set()

    def consider(module: nn.Module, qname: str, inside_block: bool) -> None:
        if _is_chain(module, inside_block, is_root=not qname):
            if qname:
                names.add(qname)
            for cname, child in module.named_children():
                cq = _join(qname, cname)
                names.add(cq)
                consider(child, cq, inside_block or _is_block(child))
            return
        for cname, child in module.named_children():
            consider(child, _join(qname, cname), inside_block)

    consider(model, "", False)
    extra_names = [str(n) for n in (extra or [])]
    if not names and not extra_names:
        if type(model).__module__.startswith("keras."):
            # Keras on its torch backend keeps every variable in one ParameterDict and does
            # not register its layers as submodules: there is nothing to walk.
            raise PlanError(
                f"{type(model).__name__} is a Keras model on the torch backend: its layers are "
                "not torch submodules (Keras holds its variables in one ParameterDict), so "
                "memfit cannot plan its checkpointing. memfit.Engine trains it (precision, "
                "loss scaling, accumulation); for a plan, run Keras on TensorFlow and use "
                "memfit.keras.plan (docs/keras.md)."
            )
        children = [f"{n} ({type(m).__name__})" for n, m in model.named_children()][:8]
        listing = f" Its top-level modules: {', '.join(children)}." if children else ""
        raise PlanError(
            f"found no blocks to checkpoint in {type(model).__name__}: no nn.ModuleList or "
            "nn.Sequential holds modules with parameters and submodules (Transformer "
            f"layers, residual blocks, RNN layers).{listing} Name the units yourself: "
            "memfit.plan(model, inputs, units=['encoder.blocks.0', ...]), "
            "memfit.Engine(..., units=[...]) or "
            "find_units(model, extra=['encoder.blocks.0', ...])."
        )
    return unit_tree(model, names | set(extra_names))


def outermost_blocks(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Of the units ``names``, those that no other of them contains, among the ones with a
    forward of their own: the blocks FSDP2 shards one by one. A container without a forward
    (a ModuleList of blocks) is no group; its members are.

    Example::

        outermost_blocks(gpt, find_units(gpt).names())  # ['blocks.0', 'blocks.1', ...]
    """
    named = [
        n for n in names if n and type(model.get_submodule(n)).forward is not nn.Module.forward
    ]
    return [n for n in named if not any(n.startswith(o + ".") for o in named if o != n)]


def structure_fingerprint(
    model: nn.Module, units: UnitTree | Iterable[str]
) -> list[tuple[str, str]]:
    """``(qualified name, class name)`` of each unit, to recognize the model a plan is for.

    Every child of a unit that is an ``nn.ModuleList`` / ``nn.Sequential`` is listed too,
    so a plan made for 12 layers is refused by a 24-layer model even when it names only
    some layers. A name the model lacks is listed with class ``"<missing>"``.

    Example::

        structure_fingerprint(model, ["", "blocks.0"])
        # [('', 'GPT'), ('blocks.0', 'Block')]
    """
    model = unwrap_compiled(model)
    wanted = units.names() if isinstance(units, UnitTree) else [str(n) for n in units]
    entries: dict[str, str] = {}
    for name in wanted:
        try:
            module = model.get_submodule(name) if name else model
        except AttributeError:
            entries[name] = "<missing>"
            continue
        entries[name] = original_class(module).__name__
        if isinstance(module, _CONTAINERS):
            for cname, child in module.named_children():
                entries.setdefault(_join(name, cname), original_class(child).__name__)
    order = _module_order(model)
    names = sorted(entries, key=lambda n: (order.get(n, len(order)), n))
    return [(n, entries[n]) for n in names]
