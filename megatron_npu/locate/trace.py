"""Which adaptor patches each module reaches.

A patch is *reached* by a module when the patch's installed code runs while the module's forward
is on the stack (the module's own code or a descendant's), or when the patch built the module
(e.g. ``norm.wrapped-torch-norm`` replaces ``WrappedTorchNorm.__new__``: its code runs once, at
model construction, and returns the norm instance). The tracer uses ``sys.setprofile`` with a
map from each applied patch's code objects to its id, so it sees calls through any binding of
the replacement (``from``-import copies included) without rebinding anything.

The sets are the culprit search's candidates (:mod:`.culprit`): ``own`` (ran while the module
was the innermost one on the stack, or built it) first, then ``total`` (the module and all its
descendants).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections import defaultdict
from collections.abc import Iterator
from types import CodeType, ModuleType, SimpleNamespace
from typing import Any

#: the methods by which an adaptor namespace answers attribute reads: plumbing, not a patch's code
_ATTRIBUTE_ROUTING = frozenset({"__getattribute__", "__getattr__"})


def _codes(obj: Any, depth: int = 0) -> Iterator[CodeType]:
    """The code objects that run when ``obj`` (a patch's installed object) is used: a
    function's, a class's methods (its own and those of its adaptor-defined bases), and -- for an
    adaptor object that routes attribute access, e.g. a namespace whose ``optim.AdamW`` is the
    adaptor's AdamW -- those of the adaptor objects it holds (a few levels deep)."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, functools.partial):
        obj = obj.func
    if isinstance(obj, property):
        for part in (obj.fget, obj.fset, obj.fdel):
            if part is not None:
                yield from _codes(part, depth)
        return
    if isinstance(obj, (SimpleNamespace, ModuleType)) and not _own_object(obj):
        # a namespace standing in for a package (``grouped_gemm``, its ``ops``): the adaptor's
        # functions it holds run when Megatron calls through it
        if depth < 3:
            for value in vars(obj).values():
                if inspect.isfunction(value) and value.__module__.startswith("megatron_npu."):
                    yield value.__code__
                elif isinstance(value, (SimpleNamespace, ModuleType)):
                    yield from _codes(value, depth + 1)
        return
    if not (inspect.isfunction(obj) or isinstance(obj, type)) and _own_object(obj):
        obj = type(obj)  # an instance installed as the replacement: its class's methods run
    if inspect.isfunction(obj):
        yield obj.__code__
    elif isinstance(obj, type):
        # the class's own methods and those it inherits from the adaptor's classes (TE's column
        # and row grouped linears share their forward): Megatron's and torch's bases are not
        # the patch's code
        # (attribute routing left out: a namespace's __getattribute__ runs on every torch.X in
        # the module it serves, and what it routes to is counted through the objects it holds)
        own_classes = [k for k in obj.__mro__ if k is obj or _own_object(k, itself=True)]
        values = [v for k in own_classes for n, v in vars(k).items() if n not in _ATTRIBUTE_ROUTING]
        for value in values:
            if isinstance(value, (staticmethod, classmethod, property)) or inspect.isfunction(
                value
            ):
                yield from _codes(value, depth)
            elif depth < 3 and _own_object(value, itself=True):
                yield from _codes(value, depth + 1)


def _own_object(obj: Any, itself: bool = False) -> bool:
    """An object (``itself``: or a class) defined in the adaptor."""
    if itself and isinstance(obj, type):
        return obj.__module__.startswith("megatron_npu.")
    return type(obj).__module__.startswith("megatron_npu.")


def _installed() -> Iterator[tuple[str, Any]]:
    """(patch id, the object it installed) for every patch applied in this process."""
    from megatron_npu import patcher

    for result in patcher.results():
        if result.status != patcher.APPLIED:
            continue
        try:
            owner, name = patcher.resolve(result.target)
            yield result.id, inspect.getattr_static(owner, name)
        except (ImportError, AttributeError):
            continue


def patch_classes() -> dict[str, type]:
    """Patch id -> the class it installs, for every applied patch whose replacement is a class
    (a method its instances run is its code only when ``self`` is one of them)."""
    return {pid: raw for pid, raw in _installed() if isinstance(raw, type)}


def patch_closures() -> dict[str, dict[str, int]]:
    """Patch id -> the identity of each value its installed function closes over, for every
    applied patch whose replacement is a closure: wrap patches built by one factory share one
    code object (the seven ``matmul.*`` wrappers), and the value each closes over (its
    ``original``) tells which of them a call runs."""
    out: dict[str, dict[str, int]] = {}
    for pid, raw in _installed():
        if inspect.isfunction(raw) and raw.__closure__:
            try:
                out[pid] = {
                    name: id(cell.cell_contents)
                    for name, cell in zip(raw.__code__.co_freevars, raw.__closure__, strict=True)
                }
            except ValueError:  # an empty cell: nothing to tell the calls apart by
                continue
    return out


def patch_code_objects() -> dict[CodeType, tuple[str, ...]]:
    """Code object -> the ids of the patches that installed it (two patches may install the
    same replacement, e.g. a class and the factory that builds it), for every patch applied in
    this process."""
    out: dict[CodeType, tuple[str, ...]] = {}
    for pid, raw in _installed():
        for code in _codes(raw):
            if pid not in out.get(code, ()):
                out[code] = (*out.get(code, ()), pid)
    return out


class Tracer:
    """Records the patches reached per module name (see the module docstring)."""

    def __init__(
        self,
        codes: dict[CodeType, tuple[str, ...]] | None = None,
        classes: dict[str, type] | None = None,
        closures: dict[str, dict[str, int]] | None = None,
    ) -> None:
        self.codes = patch_code_objects() if codes is None else codes
        self.classes = patch_classes() if classes is None else classes
        self.closures = patch_closures() if closures is None else closures
        self.stack: list[str] = []
        self.own: dict[str, set[str]] = defaultdict(set)
        self.total: dict[str, set[str]] = defaultdict(set)
        self.built: dict[int, tuple[str, ...]] = {}  # id(module) -> the patches that built it
        self._building = False

    def _profile(self, frame, event: str, arg: Any) -> None:
        if event == "call":
            pids = self.codes.get(frame.f_code)
            if pids is not None and self.stack:
                if not self.classes.keys().isdisjoint(pids):
                    pids = self._for_instance(pids, frame)
                if len(pids) > 1 and not self.closures.keys().isdisjoint(pids):
                    pids = self._for_closure(pids, frame)
                self.own[self.stack[-1]].update(pids)
                for name in self.stack:
                    self.total[name].update(pids)
        elif event == "return" and self._building:
            pids = self.codes.get(frame.f_code)
            if pids is not None and arg is not None and hasattr(arg, "named_modules"):
                self.built.setdefault(id(arg), pids)

    def _for_instance(self, pids: tuple[str, ...], frame) -> tuple[str, ...]:
        """Of the patches whose code a method is, those it runs for here: a class patch only when
        the running instance is of its installed class (the adaptor's local norm runs the
        ``forward`` that the TE norm class inherits, and is no TE norm); patches that install
        no class always. All of them when the call has no ``self``."""
        owner = frame.f_locals.get("self")
        if owner is None:
            return pids
        mro = type(owner).__mro__
        return tuple(p for p in pids if p not in self.classes or self.classes[p] in mro)

    def _for_closure(self, pids: tuple[str, ...], frame) -> tuple[str, ...]:
        """Of the patches that share a closure's code, those whose closed-over values the
        running frame holds (all of them when none matches)."""
        local = frame.f_locals
        kept = tuple(
            p
            for p in pids
            if p not in self.closures
            or all(
                name in local and id(local[name]) == value
                for name, value in self.closures[p].items()
            )
        )
        return kept or pids

    @contextlib.contextmanager
    def active(self, building: bool = False) -> Iterator[None]:
        """Trace calls inside the block (``building``: also note which patch built a module)."""
        if not self.codes:
            yield
            return
        previous = sys.getprofile()
        self._building = building
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(previous)
            self._building = False

    @contextlib.contextmanager
    def attributed(self, owner: Any, attr: str, name: str) -> Iterator[None]:
        """Inside the block, what ``owner.attr`` runs counts as module ``name``'s (e.g. the
        optimizer's build and step as the pseudo-module ``optimizer``)."""
        original = getattr(owner, attr)

        def traced(*args, **kwargs):
            self.enter(name)
            try:
                return original(*args, **kwargs)
            finally:
                self.leave(name)

        setattr(owner, attr, traced)
        try:
            yield
        finally:
            setattr(owner, attr, original)

    def enter(self, name: str) -> None:
        self.stack.append(name)

    def leave(self, name: str) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()

    def reached(self, name: str, module: Any = None) -> dict[str, list[str]]:
        """``{"own": [...], "total": [...]}`` for module ``name`` (sorted patch ids)."""
        own = set(self.own.get(name, ()))
        total = set(self.total.get(name, ()))
        if module is not None:
            for sub in module.modules():
                pids = self.built.get(id(sub), ())
                total.update(pids)
                if sub is module:
                    own.update(pids)
        return {"own": sorted(own), "total": sorted(total | own)}
