"""Doors on the manager's shared state, checked by an AST scan of src/kvpool.

The block manager's modules (kvpool.core) work on one ``CacheState``. Each of its fields has one
owner, the only module that may write it: assign it, augment it, or change it in place (a
subscript assignment, ``append``, ``pop``, ...). The objects some fields hold have owners too
(a ``SlotPool``'s free list, queue and reference counts are changed only by ``core/slots.py``'s
methods; the stats only by ``core/stats.py``'s; the emitter's state only by ``core/emit.py``;
a call's copies only by ``tiers/copies.py``; the plan view only by ``core/views.py``). Every
other module goes through their methods. And no module reads a private attribute
(``obj._x``, ``obj`` not ``self`` or ``cls``) that only another kvpool module defines.

The scan follows what a function's names hold: a parameter annotated ``CacheState`` (or a
``SlotPool``/``Pool``), ``self.x`` set from one, and local aliases of their fields and of what
the fields hold (``gpu = state.gpu``, ``pool = gpu[g]``, ``ref = pool.ref``, ``for pool in
gpu``). It cannot see through calls that return parts of the state or through containers of
other objects; it is a door check, not a type checker. ``tests/doors_fixture.py`` holds one
deliberate violation of each kind, which the scan must find.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "kvpool"
FIXTURE = Path(__file__).resolve().parent / "doors_fixture.py"

STATE = "core/state.py"

OWNED_CLASSES: dict[str, str] = {
    # class -> the module that owns (alone may write) its instances' attributes
    "CacheState": STATE,
    "SlotPool": "core/slots.py",
    "CacheStats": "core/stats.py",
    "Emitter": "core/emit.py",
    "CallCopies": "tiers/copies.py",
    "PlanView": "core/views.py",
}


@dataclass(frozen=True)
class Field:
    """A CacheState field: its owner, and what it holds (an owned class ``depth`` subscripts
    in, a container changed in place, or a plain value)."""

    owner: str
    holds: str | None = None  # an OWNED_CLASSES name
    depth: int = 0
    container: bool = False


FIELDS: dict[str, Field] = {
    "pools": Field(STATE, "SlotPool", 2),  # [tier][group]
    "gpu": Field(STATE, "SlotPool", 1),  # [group]
    "stats": Field(STATE, "CacheStats"),
    "emit": Field(STATE, "Emitter"),
    "copies": Field(STATE, "CallCopies"),
    "view": Field(STATE, "PlanView"),
    "layout": Field(STATE),  # frozen (kvpool.core.layout)
    "sequences": Field(STATE, container=True),
    "roots": Field(STATE, container=True),
    "_hashers": Field(STATE, container=True),
    "pending_free": Field(STATE, container=True),
    "new_count": Field("core/allocator.py", container=True),
    "clock": Field(STATE),
    "config": Field(STATE),
    "storage": Field(STATE),
    "copy_failure": Field(STATE),
    "failed_copies": Field(STATE),
    "retention_seen": Field("core/commit.py"),  # set when a block takes a retention
    # the hooks a manager plugs in (kvpool.core.manager builds them)
    "persist": Field("core/manager.py"),
    "remote": Field("core/manager.py"),
    "repair_copies": Field("core/manager.py"),
}

MUTATORS = frozenset({
    "append", "extend", "insert", "pop", "remove", "clear", "update", "add", "discard",
    "setdefault", "popitem", "sort", "reverse", "appendleft", "popleft", "extendleft",
    "remove_many", "__setitem__", "__delitem__",
})
READERS = frozenset({"get", "count", "index", "copy", "keys", "values", "items", "should_offload",
                     "peek_order"})


# ---------------------------------------------------------------- what an expression holds

@dataclass(frozen=True)
class StateRef:
    """A CacheState."""


@dataclass(frozen=True)
class FieldRef:
    """A CacheState field, ``subs`` subscripts in (short of the object it holds)."""

    field: str
    subs: int = 0


@dataclass(frozen=True)
class ObjRef:
    """An instance of an owned class."""

    cls: str


@dataclass(frozen=True)
class AttrRef:
    """An attribute of an owned class's instance, or (``elem``) one of the items it holds
    (a slot's reference count, the run a slot points back to: other objects, not tracked)."""

    cls: str
    attr: str
    elem: bool = False


Ref = StateRef | FieldRef | ObjRef | AttrRef


def _data_attrs() -> dict[str, set[str]]:
    """Each owned class's data attributes (slots, class-level annotations, ``self.x =``)."""
    out: dict[str, set[str]] = {name: set() for name in OWNED_CLASSES}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in out:
                attrs = out[node.name]
                for item in ast.walk(node):
                    if isinstance(item, ast.Assign) and any(
                            isinstance(t, ast.Name) and t.id == "__slots__" for t in item.targets):
                        attrs.update(c.value for c in ast.walk(item.value)
                                     if isinstance(c, ast.Constant) and isinstance(c.value, str))
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        attrs.add(item.target.id)
                    elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) \
                            and isinstance(item.value, ast.Name) and item.value.id == "self":
                        attrs.add(item.attr)
    return out


DATA_ATTRS = _data_attrs()


def _annotation_ref(ann: ast.expr | None) -> Ref | None:
    if ann is None:
        return None
    text = ann.value if isinstance(ann, ast.Constant) and isinstance(ann.value, str) \
        else ast.unparse(ann)
    head = text.split("[", 1)[0].strip().rsplit(".", 1)[-1]
    if head == "CacheState":
        return StateRef()
    if head in ("SlotPool", "Pool"):
        return ObjRef("SlotPool")
    return None


def _settle(ref: Ref) -> Ref:
    """A field at the depth of the object it holds is that object."""
    if isinstance(ref, FieldRef):
        spec = FIELDS[ref.field]
        if spec.holds is not None and ref.subs >= spec.depth:
            return ObjRef(spec.holds)
    return ref


class _Scope:
    def __init__(self, names: dict[str, Ref], self_attrs: dict[str, Ref]) -> None:
        self.names = names
        self.self_attrs = self_attrs

    def resolve(self, node: ast.expr) -> Ref | None:
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr in self.self_attrs:
                return self.self_attrs[node.attr]
            base = self.resolve(node.value)
            if isinstance(base, StateRef):
                return _settle(FieldRef(node.attr)) if node.attr in FIELDS else None
            if isinstance(base, ObjRef):
                return AttrRef(base.cls, node.attr) if node.attr in DATA_ATTRS[base.cls] \
                    else None
            if isinstance(base, AttrRef) and not base.elem:
                return base
            return None
        if isinstance(node, ast.Subscript):
            return self.element(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "CacheState":
            return StateRef()
        return None

    def element(self, node: ast.expr) -> Ref | None:
        """What iterating over ``node`` yields."""
        base = self.resolve(node)
        if isinstance(base, FieldRef):
            return _settle(FieldRef(base.field, base.subs + 1))
        if isinstance(base, AttrRef) and not base.elem:
            return AttrRef(base.cls, base.attr, elem=True)
        return None


# ---------------------------------------------------------------- the scan

def _write_owner(ref: Ref | None, attr: str | None) -> tuple[str, str] | None:
    """(what, owner) of a write into ``ref`` (``.attr`` of it, when given), or None when the
    write is not to shared state."""
    if isinstance(ref, StateRef) and attr is not None and attr in FIELDS:
        return f"CacheState.{attr}", FIELDS[attr].owner
    if isinstance(ref, ObjRef) and attr is not None:
        return f"{ref.cls}.{attr}", OWNED_CLASSES[ref.cls]
    if isinstance(ref, AttrRef) and not ref.elem:
        return f"{ref.cls}.{ref.attr}", OWNED_CLASSES[ref.cls]
    if isinstance(ref, FieldRef) and attr is None:
        return f"CacheState.{ref.field}", FIELDS[ref.field].owner
    return None


def _private_defs() -> dict[str, set[str]]:
    """Private names (``_x``, not dunders) each kvpool module defines: functions, classes,
    class attributes, slots and ``self._x =`` attributes."""
    out: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.isidentifier():
                names.add(node.value)  # __slots__ entries
        out[path.relative_to(PKG).as_posix()] = {
            n for n in names if n.startswith("_") and not n.startswith("__")}
    return out


PRIVATE_DEFS = _private_defs()
KVPOOL_PRIVATES = set().union(*PRIVATE_DEFS.values())


class _Scanner(ast.NodeVisitor):
    def __init__(self, module: str, tree: ast.Module) -> None:
        self.module = module
        self.found: list[str] = []
        self.own_privates = PRIVATE_DEFS.get(module, set())
        self.scopes = [_Scope({}, {})]
        self.tree = tree

    # names

    def _bind(self, target: ast.expr, value: ast.expr | None, ref: Ref | None = None) -> None:
        scope = self.scopes[-1]
        if isinstance(target, ast.Name):
            if ref is None and value is not None:
                ref = scope.resolve(value)
            if ref is not None:
                scope.names[target.id] = ref
            else:
                scope.names.pop(target.id, None)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._bind(t, v)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                and target.value.id == "self" and value is not None:
            got = scope.resolve(value)
            if isinstance(got, StateRef):
                scope.self_attrs[target.attr] = got

    def _functions(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        outer = self.scopes[-1]
        names = dict(outer.names)
        args = node.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            ref = _annotation_ref(a.annotation)
            if ref is not None:
                names[a.arg] = ref
            else:
                names.pop(a.arg, None)
        self.scopes.append(_Scope(names, outer.self_attrs))
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _functions

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer = self.scopes[-1]
        scope = _Scope(dict(outer.names), {})
        # self.x = <a CacheState> anywhere in the class makes self.x one in every method
        for item in ast.walk(node):
            if isinstance(item, ast.FunctionDef):
                params = {a.arg: r for a in item.args.args
                          if (r := _annotation_ref(a.annotation)) is not None}
                probe = _Scope(params, {})
                for sub in ast.walk(item):
                    if isinstance(sub, ast.Assign):
                        for t in sub.targets:
                            if isinstance(t, ast.Name):
                                ref = probe.resolve(sub.value)
                                if ref is not None:
                                    probe.names[t.id] = ref
                            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                                    and t.value.id == "self" \
                                    and isinstance(probe.resolve(sub.value), StateRef):
                                scope.self_attrs[t.attr] = StateRef()
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                ref = _annotation_ref(item.annotation)
                if isinstance(ref, StateRef):
                    scope.self_attrs[item.target.id] = ref
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    # writes

    def _report(self, node: ast.AST, what: str, owner: str) -> None:
        if owner != self.module and not (what.startswith("CacheState.") and self.module == STATE):
            self.found.append(f"{self.module}:{node.lineno}: writes {what} (owner: {owner})")

    def _check_target(self, target: ast.expr) -> None:
        scope = self.scopes[-1]
        if isinstance(target, ast.Tuple | ast.List):
            for t in target.elts:
                self._check_target(t)
            return
        if isinstance(target, ast.Starred):
            self._check_target(target.value)
            return
        hit = None
        if isinstance(target, ast.Attribute):
            hit = _write_owner(scope.resolve(target.value), target.attr)
        elif isinstance(target, ast.Subscript):
            hit = _write_owner(scope.resolve(target.value), None)
        if hit is not None:
            self._report(target, *hit)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for t in node.targets:
            self._check_target(t)
        for t in node.targets:
            self._bind(t, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if node.value is not None:
            self._check_target(node.target)
            self._bind(node.target, node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.generic_visit(node)
        self._check_target(node.target)

    def visit_Delete(self, node: ast.Delete) -> None:
        self.generic_visit(node)
        for t in node.targets:
            self._check_target(t)

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        self._bind(node.target, None, self.scopes[-1].element(node.iter))
        for stmt in [*node.body, *node.orelse]:
            self.visit(stmt)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        func = node.func
        if not isinstance(func, ast.Attribute):
            return
        ref = self.scopes[-1].resolve(func.value)
        if isinstance(ref, AttrRef) and not ref.elem and func.attr not in READERS:
            self._report(node, f"{ref.cls}.{ref.attr} (.{func.attr})", OWNED_CLASSES[ref.cls])
        elif isinstance(ref, FieldRef) and func.attr in MUTATORS:
            self._report(node, f"CacheState.{ref.field} (.{func.attr})",
                         FIELDS[ref.field].owner)

    # reads

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.generic_visit(node)
        attr = node.attr
        if not attr.startswith("_") or attr.startswith("__"):
            return
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            return
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) \
                and base.func.id == "super":
            return
        if attr in KVPOOL_PRIVATES and attr not in self.own_privates:
            self.found.append(f"{self.module}:{node.lineno}: reads {ast.unparse(node)} "
                              "(private to another module)")


def scan(module: str, source: str) -> list[str]:
    """The door violations of one module (``module`` as a path under src/kvpool)."""
    tree = ast.parse(source)
    scanner = _Scanner(module, tree)
    scanner.visit(tree)
    return scanner.found


# ---------------------------------------------------------------- tests

def _state_slots() -> set[str]:
    tree = ast.parse((PKG / STATE).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "CacheState":
            for item in node.body:
                if isinstance(item, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == "__slots__" for t in item.targets):
                    return {c.value for c in ast.walk(item.value)
                            if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    raise AssertionError("CacheState.__slots__ not found")


def test_every_state_field_has_an_owner() -> None:
    """A new CacheState field must say who owns it (FIELDS)."""
    assert sorted(_state_slots() ^ set(FIELDS)) == []


def test_owned_classes_exist() -> None:
    for cls, attrs in DATA_ATTRS.items():
        assert attrs, f"class {cls} not found (or has no data attributes) in src/kvpool"


def test_no_module_writes_state_it_does_not_own() -> None:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        found += scan(path.relative_to(PKG).as_posix(), path.read_text())
    assert found == []


def test_the_scan_finds_each_kind_of_violation() -> None:
    """The fixture, scanned as a core module, breaks each rule once per marked line."""
    source = FIXTURE.read_text()
    expected = {i for i, line in enumerate(source.splitlines(), 1) if "# VIOLATION" in line}
    found = scan("core/intruder.py", source)
    lines = {int(f.split(":")[1]) for f in found}
    assert lines == expected, "\n".join(found)
    # the owner itself may do what the fixture does to its own class
    assert not [f for f in scan("core/slots.py", source) if "SlotPool." in f]
