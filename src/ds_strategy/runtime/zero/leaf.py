"""ZeRO-3 leaf modules: modules whose whole subtree stage 3 gathers as one unit (DeepSpeed's
``deepspeed.utils.set_z3_leaf_modules`` family and the ``zero_optimization.leaf_module`` config).

[Note: leaf modules]
Stage 3 gathers a module's own parameters around each call of that module (see [Note: gather units and
hooks] in param_gather.py), so every rank must call the same modules in the same order. A mixture-of-
experts block that calls each expert only for the tokens routed to it breaks that: the experts called
depend on each rank's data, and the ranks stop at "ranks diverged at parameter gather". Marking the
block a *leaf* makes its unit the parameters of its whole subtree, gathered before the block's forward
(and again before its backward); its descendants get no unit, so whatever they do inside the block
issues no collective, and every rank issues the same gathers. An expert that no token of this rank
reached gets no gradient here: its slots of the reduced bucket are zero on this rank (base.py's reducing
pass launches every bucket, zero-filling what got no gradient), so the reduction still averages over all
ranks, and its bucket stays gathered until the end of backward.

The flag is DeepSpeed's ``_z3_leaf`` module attribute (a model marked with ``deepspeed.utils`` is a model
marked here). Marking takes effect when a stage-3 engine is built: the gather units are computed then,
and the bucket layout keeps each leaf's subtree together (one leaf, few buckets). Marking or unmarking
afterwards takes effect at the engine's next root forward (``leaf_generation`` tells the gatherer that
something changed); the layout stays as built, so the leaf's unit is then the union of its descendants'
buckets. Stages 0-2 gather nothing: the marking is a no-op there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from ds_strategy.config.model import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig
from ds_strategy.log import get_logger

log = get_logger("ds_strategy.runtime")

LEAF_ATTR = "_z3_leaf"  # on a module: DeepSpeed's flag name
LEAF_PARAM_ATTR = "_ds_z3_leaf"  # on a parameter of a leaf's subtree (what ``z3_leaf_parameter`` reads)

ModuleClass = type[nn.Module] | str

_generation = 0  # bumped by every change of a flag: a built gatherer recomputes its units when it moves


def leaf_generation() -> int:
    """A counter that changes whenever some module's leaf flag is set or cleared through this module."""
    return _generation


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is flagged as a ZeRO-3 leaf module."""
    return bool(getattr(module, LEAF_ATTR, False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to the subtree of a flagged leaf module (as of the last marking)."""
    return bool(getattr(param, LEAF_PARAM_ATTR, False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` (itself included) flagged as a leaf, in ``modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(module: nn.Module, flag: bool) -> None:
    """Set or clear the leaf flag of ``module`` itself."""
    _flag([module], flag)
    _sync_parameter_flags(module)


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[ModuleClass] | ModuleClass, *, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Flag every submodule of ``model`` (itself included) that is an instance of one of
    ``leaf_module_classes`` as a ZeRO-3 leaf: stage 3 then gathers its whole subtree as one unit, so
    data-dependent calls inside it (a mixture of experts' routing) cannot make the ranks diverge. Entries
    are classes (subclasses match too) or class names (``__name__``, ``__qualname__`` or the fully qualified
    ``module.QualName``). Returns the flagged modules; raises ``ValueError`` when none matches (unless
    ``raise_if_not_found=False``). Call it before the engine is built, so the bucket layout keeps each leaf
    together (later calls take effect at the next forward). See [Note: leaf modules]."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found, "set_z3_leaf_modules")


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[ModuleClass] | ModuleClass, *, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Clear the leaf flag of every submodule matching ``leaf_module_classes`` (as ``set_z3_leaf_modules``
    matches them); returns those modules, raises ``ValueError`` when none matches."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found, "unset_z3_leaf_modules")


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], *, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Set (or, ``flag=False``, clear) the leaf flag of the modules named ``module_names`` (names as
    ``model.named_modules()`` gives them). Returns the modules found and the names that matched none;
    raises ``ValueError`` naming the missing ones unless ``raise_if_not_found=False``."""
    names = _strings(module_names, "module_names", "set_z3_leaf_modules_by_name")
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in names if n in by_name]
    missing = [n for n in names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(
            f"set_z3_leaf_modules_by_name: no module named {missing} in {type(model).__name__}; names are "
            f"those of model.named_modules(), e.g. {_sample([n for n in by_name if n])}"
        )
    _flag(found, flag)
    _sync_parameter_flags(model)
    return _unique(found), missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], *, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Set (or clear) the leaf flag of every module whose ``named_modules()`` name ends with one of
    ``module_name_suffixes``. Returns the modules found and the suffixes that matched none; raises
    ``ValueError`` naming those unless ``raise_if_not_found=False``."""
    suffixes = _strings(module_name_suffixes, "module_name_suffixes", "set_z3_leaf_modules_by_suffix")
    named = [(n, m) for n, m in model.named_modules() if n]
    found = [m for s in suffixes for n, m in named if n.endswith(s)]
    missing = [s for s in suffixes if not any(n.endswith(s) for n, _ in named)]
    if missing and raise_if_not_found:
        raise ValueError(
            f"set_z3_leaf_modules_by_suffix: no module name of {type(model).__name__} ends with {missing}; "
            f"names are those of model.named_modules(), e.g. {_sample([n for n, _ in named])}"
        )
    _flag(found, flag)
    _sync_parameter_flags(model)
    return _unique(found), missing


def apply_leaf_module_config(model: nn.Module, config: LeafModuleConfig) -> list[nn.Module]:
    """Flag what ``zero_optimization.leaf_module`` selects; the engine calls it before
    building its stage. Entries that match nothing are skipped (DeepSpeed's default class list names
    transformers' MoE blocks, absent from most models); a user-given list that matches nothing is logged.
    Returns the flagged modules."""
    out: list[nn.Module] = []
    if config.classes:
        out += set_z3_leaf_modules(model, list(config.classes), raise_if_not_found=False)
    found, missing = set_z3_leaf_modules_by_name(model, list(config.names), raise_if_not_found=False)
    out += found
    if missing:
        log.warning("zero_optimization.leaf_module.names: no module named %s in the model", missing)
    found, missing = set_z3_leaf_modules_by_suffix(model, list(config.name_suffixes), raise_if_not_found=False)
    out += found
    if missing:
        log.warning("zero_optimization.leaf_module.name_suffixes: no module name ends with %s", missing)
    if not out and tuple(config.classes) != DEFAULT_LEAF_MODULE_CLASSES:
        log.warning("zero_optimization.leaf_module.classes %s match no module of the model", list(config.classes))
    return _unique(out)


def outermost_leaves(root: nn.Module) -> dict[int, nn.Module]:
    """``id(module)`` -> the outermost flagged leaf whose subtree holds it (a leaf maps to itself), for every
    module of ``root`` inside a leaf; modules outside every leaf are absent."""
    out: dict[int, nn.Module] = {}

    def visit(module: nn.Module, leaf: nn.Module | None) -> None:
        if leaf is None and z3_leaf_module(module):
            leaf = module
        if leaf is not None:
            out.setdefault(id(module), leaf)
        for child in module.children():
            visit(child, leaf)

    visit(root, None)
    return out


# ---------------------------------------------------------------------- helpers
def _set_by_class(
    model: nn.Module, classes: Sequence[ModuleClass] | ModuleClass, flag: bool, raise_if_not_found: bool, caller: str
) -> list[nn.Module]:
    wanted = [classes] if isinstance(classes, (str, type)) else list(classes)
    bad = [c for c in wanted if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)))]
    if bad:
        raise TypeError(f"{caller}: leaf_module_classes must be nn.Module classes or class names, got {bad!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in wanted)]
    if not found and raise_if_not_found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"{caller}: no module of {type(model).__name__} matches {[_label(c) for c in wanted]}; its module "
            f"classes are {_sample(present)}. Give classes or class names (__name__ or module.QualName)."
        )
    _flag(found, flag)
    _sync_parameter_flags(model)
    return found


def _matches(module: nn.Module, wanted: ModuleClass) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}")


def _flag(modules: Iterable[nn.Module], flag: bool) -> None:
    global _generation
    for m in modules:
        if z3_leaf_module(m) != flag:
            _generation += 1
        setattr(m, LEAF_ATTR, flag)


def _sync_parameter_flags(model: nn.Module) -> None:
    """Re-derive ``z3_leaf_parameter`` for ``model``'s parameters from the flags now set."""
    inside = {id(p) for leaf in get_z3_leaf_modules(model) for p in leaf.parameters()}
    for p in model.parameters():
        if id(p) in inside:
            setattr(p, LEAF_PARAM_ATTR, True)
        elif hasattr(p, LEAF_PARAM_ATTR):
            delattr(p, LEAF_PARAM_ATTR)


def _strings(values: Sequence[str], what: str, caller: str) -> list[str]:
    items = [values] if isinstance(values, str) else list(values)
    bad = [v for v in items if not isinstance(v, str)]
    if bad:
        raise TypeError(f"{caller}: {what} must be strings, got {bad!r}")
    return items


def _unique(modules: Iterable[nn.Module]) -> list[nn.Module]:
    return list({id(m): m for m in modules}.values())


def _label(wanted: ModuleClass) -> str:
    return wanted if isinstance(wanted, str) else wanted.__name__


def _sample(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"
