"""Applying and restoring registry patches.

Rules this module guarantees (each has a test in ``tests/test_patcher.py``):

* :func:`apply` is idempotent; re-applying for another device first restores, so wrappers never
  stack (a wrap patch is always built from the pristine original).
* :func:`restore` puts back exactly the original objects, at every site that was rebound.
* Copies bound by ``from x import f`` in modules imported before :func:`apply` are rebound too;
  copies taken by modules imported *while* applied (they copy the replacement) are found at
  :func:`restore` from those modules' ``from ... import`` statements and put back as well.
* Strict targets: a target missing from the installed megatron-core raises
  :class:`PatchTargetError` naming the patch, the target and the installed version, unless the
  patch's version range excludes that version (then it is recorded as skipped). A missing
  attribute is never created.
* The replacement's signature is checked against the target's; a mismatch raises
  :class:`PatchSignatureError`.
* Methods are patched on the class in place, so subclasses defined after :func:`apply` inherit the
  patched behaviour.
* Per-patch off switch: ids listed in ``$MEGATRON_NPU_DISABLE`` (comma-separated), given to
  ``--disable-patch`` or passed as ``apply(disable=...)`` are not installed and are reported with
  status ``disabled`` and the switch that disabled them; an unknown id is an error naming it.
  The ``--disable-patch`` option itself lives with the command line
  (:mod:`megatron_npu.disable_patch_option`).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import threading
import unittest.mock
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_npu.devices.torch_npu_schema import missing_kernel_message
from megatron_npu.registry import Patch, all_patches

APPLIED = "applied"
SKIPPED_BY_VERSION = "skipped-by-version"
NOT_FOR_DEVICE = "not-for-this-device"
FAILED = "failed"
DISABLED = "disabled"
#: the package holding the target (``Patch.requires``) is not importable in this process
NOT_INSTALLED = "not-installed"
#: the replacement built for the target is the target itself (a wrap that found nothing to
#: replace, e.g. apex's kernel where it serves only Megatron's fallback): nothing was installed
KEPT_ORIGINAL = "kept-original"
STATUSES = (
    APPLIED,
    SKIPPED_BY_VERSION,
    NOT_FOR_DEVICE,
    FAILED,
    DISABLED,
    NOT_INSTALLED,
    KEPT_ORIGINAL,
)

#: Comma-separated patch ids the user switched off.
DISABLE_ENV = "MEGATRON_NPU_DISABLE"
#: Comma-separated patch ids switched off with ``--disable-patch`` (published by the command while
#: it runs, so the ranks and parity workers it launches see them too).
DISABLE_FLAG_ENV = "MEGATRON_NPU_DISABLE_FLAG"
DISABLE_FLAG = "--disable-patch"

_MISSING = object()


class PatchError(RuntimeError):
    """A patch could not be applied."""


class PatchTargetError(PatchError):
    """The patch's target does not exist in the installed megatron-core."""


class PatchSignatureError(PatchError):
    """The replacement's signature does not match the target's."""


class MissingKernelError(PatchError):
    """The device's torch_npu lacks a kernel the patch's NPU path calls."""


class UnknownPatchError(PatchError, ValueError):
    """A patch id given to the off switch is not in the registry."""


@dataclass
class PatchResult:
    id: str
    target: str
    status: str
    reason: str
    sites: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Site:
    owner: Any
    name: str
    original: Any  # the raw attribute (descriptor included) or _MISSING if inherited
    installed: Any


@dataclass
class _State:
    device: str | None = None
    patch_ids: tuple[str, ...] = ()
    sites: list[_Site] = field(default_factory=list)
    results: list[PatchResult] = field(default_factory=list)
    originals: dict[str, Any] = field(default_factory=dict)
    #: ``id(module)`` of every module loaded when apply() began (later ones are scanned at restore)
    modules_before: set[int] = field(default_factory=set)
    #: the arguments of the apply() in force, so :func:`applied_for` can put it back
    call: dict[str, Any] | None = None


_state = _State()
_lock = threading.RLock()


def megatron_core_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def megatron_core_below(version: str) -> bool:
    """Whether the installed megatron-core is older than ``version`` (its pre-releases too)."""
    from packaging.version import Version

    return Version(megatron_core_version()) < Version(version)


def resolve(target: str) -> tuple[Any, str]:
    """Return ``(owner, attribute name)`` for a dotted target; raise AttributeError/ImportError."""
    parts = target.split(".")
    module = None
    index = len(parts) - 1
    while index > 0:
        name = ".".join(parts[:index])
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as exc:
            if exc.name is not None and not name.startswith(exc.name) and exc.name != name:
                raise  # the module exists but one of *its* imports is missing
            index -= 1
    if module is None:
        raise ModuleNotFoundError(f"no importable module in {target!r}")
    owner: Any = module
    for part in parts[index:-1]:
        owner = getattr(owner, part)
    if not hasattr(owner, parts[-1]):
        raise AttributeError(f"{owner!r} has no attribute {parts[-1]!r}")
    return owner, parts[-1]


def _raw_attribute(owner: Any, name: str) -> tuple[Any, bool]:
    """The attribute as stored (descriptors kept) and whether ``owner`` itself holds it."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return vars(klass)[name], klass is owner
    return getattr(owner, name), True


def _unwrap_descriptor(raw: Any) -> tuple[Any, type | None]:
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__, type(raw)
    return raw, None


def _param_shape(fn: Any) -> list[tuple[str, Any, bool]]:
    sig = inspect.signature(fn, follow_wrapped=False)
    return [(p.name, p.kind, p.default is not p.empty) for p in sig.parameters.values()]


def _signature_of(obj: Any) -> Any:
    if isinstance(obj, type):
        return obj.__init__
    return obj


def check_signature(patch: Patch, original: Any, replacement: Any) -> None:
    """Raise :class:`PatchSignatureError` unless both take the same parameters."""
    if not (callable(original) and callable(replacement)):
        return
    try:
        want = _param_shape(_signature_of(original))
        got = _param_shape(_signature_of(replacement))
    except (TypeError, ValueError):  # builtins without introspectable signatures
        return
    if want != got:
        raise PatchSignatureError(
            f"patch {patch.id!r}: replacement for {patch.target} has signature "
            f"{inspect.signature(_signature_of(replacement), follow_wrapped=False)}, but the "
            f"target has {inspect.signature(_signature_of(original), follow_wrapped=False)} "
            "(parameter names, kinds and which have defaults must match)"
        )


def _rebindable(owner: Any, original: Any) -> bool:
    """Whether ``from owner import name`` copies of ``original`` are rebound too: functions and
    classes, and the ``MagicMock`` objects megatron-core binds TE's class names to when
    Transformer Engine is not installed (each one a distinct object, so a copy is found by
    identity as a class is)."""
    return inspect.ismodule(owner) and (
        inspect.isroutine(original)
        or isinstance(original, type)
        or isinstance(original, unittest.mock.NonCallableMock)
    )


#: Top-level packages that cannot hold a copy of a Megatron object: Megatron-Core is built on them
#: (they never import it), plus the standard library. Skipping them keeps apply() fast: they hold
#: about nine tenths of the module globals a Megatron process has loaded.
_BELOW_MEGATRON = frozenset(sys.stdlib_module_names) | {
    "megatron_npu",
    "torch",
    "torchgen",
    "functorch",
    "numpy",
    "sympy",
    "mpmath",
    "networkx",
}


def _copy_index(originals: Iterable[Any]) -> dict[int, list[tuple[Any, str]]]:
    """Where each of ``originals`` is bound as a module global (``from x import f`` copies),
    found in one pass over ``sys.modules`` for the whole apply (not one pass per patch); the
    packages of :data:`_BELOW_MEGATRON` are not searched."""
    wanted = {id(o) for o in originals}
    index: dict[int, list[tuple[Any, str]]] = {}
    if not wanted:
        return index
    for modname, module in list(sys.modules.items()):
        if module is None or modname.partition(".")[0] in _BELOW_MEGATRON:
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for key, value in list(namespace.items()):
            if id(value) in wanted:
                index.setdefault(id(value), []).append((module, key))
    return index


def _rebind_candidates(patches: Iterable[Patch]) -> list[Any]:
    """Originals of the patches that rebind copies (unresolvable targets are left to apply)."""
    found = []
    for patch in patches:
        if not patch.rebind_copies:
            continue
        try:
            owner, name = resolve(patch.target)
        except (ImportError, AttributeError):
            continue
        original = _unwrap_descriptor(_raw_attribute(owner, name)[0])[0]
        if _rebindable(owner, original):
            found.append(original)
    return found


def _is_pass_through(original: Any, wrapper: Any) -> bool:
    """A ``(*args, **kwargs)`` wrapper that declares (``functools.wraps``) what it wraps."""
    if getattr(wrapper, "__wrapped__", None) is not original:
        return False
    try:
        kinds = [
            p.kind for p in inspect.signature(wrapper, follow_wrapped=False).parameters.values()
        ]
    except (TypeError, ValueError):
        return False
    return kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]


def _resolve_for(patch: Patch) -> tuple[Any, str]:
    """``resolve``, except that a ``creates`` patch's target may be missing from its module."""
    try:
        return resolve(patch.target)
    except AttributeError:
        if not patch.creates:
            raise
        module_name, _, name = patch.target.rpartition(".")
        return importlib.import_module(module_name), name


def _plan(patch: Patch, copies: dict[int, list[tuple[Any, str]]]) -> list[_Site]:
    """Build ``patch``'s replacement and every site it goes to, changing nothing yet; no site
    when the replacement is the original itself."""
    owner, name = _resolve_for(patch)
    if patch.creates and not hasattr(owner, name):
        _state.originals[patch.id] = None
        return [_Site(owner, name, _MISSING, patch.replacement)]
    raw, own = _raw_attribute(owner, name)
    original, descriptor = _unwrap_descriptor(raw)
    _state.originals[patch.id] = original
    new = patch.build(original)
    if new is original:
        return []
    if patch.check_signature and not (patch.kind == "wrap" and _is_pass_through(original, new)):
        check_signature(patch, original, new)
    installed = (
        descriptor(new) if descriptor is not None and not isinstance(new, descriptor) else new
    )
    sites = [_Site(owner, name, raw if own else _MISSING, installed)]
    if patch.rebind_copies and _rebindable(owner, original):
        sites += [
            _Site(mod, key, original, new)
            for mod, key in copies.get(id(original), ())
            if mod is not owner
        ]
    return sites


def _qualified_name(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}" if module else name


def _install(sites: list[_Site], installed: list[_Site]) -> None:
    """Bind every site, appending each to ``installed`` as soon as it is bound."""
    for site in sites:
        setattr(site.owner, site.name, site.installed)
        installed.append(site)


def _as_patch_error(patch: Patch, exc: Exception, version: str) -> PatchError:
    if isinstance(exc, PatchError):
        return exc
    if isinstance(exc, (ImportError, AttributeError)):
        return PatchTargetError(
            f"patch {patch.id!r}: target {patch.target} does not exist in the installed "
            f"megatron-core {version} ({exc}); the patch declares versions "
            f"{patch.versions or 'any'!r}: narrow its range or fix the target"
        )
    return PatchError(
        f"patch {patch.id!r}: building or installing the replacement for {patch.target} "
        f"raised {type(exc).__name__}: {exc}"
    )


def _uninstall(sites: Iterable[_Site]) -> None:
    for site in reversed(list(sites)):
        if site.original is _MISSING:
            if site.name in vars(site.owner):
                delattr(site.owner, site.name)
        else:
            setattr(site.owner, site.name, site.original)


def _import_froms(module: Any) -> list[tuple[str, str, str]]:
    """``(source module, name, bound as)`` for every ``from x import name [as y]`` in the source
    of ``module`` (relative imports resolved); empty when it has no readable Python source."""
    spec = getattr(module, "__spec__", None)
    loader = getattr(spec, "loader", None)
    try:
        source = loader.get_source(module.__name__) if loader is not None else None
    except (ImportError, OSError, AttributeError):
        source = None
    if not source:
        return []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    package = getattr(module, "__package__", None) or ""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            if node.level - 1 >= len(parts):
                continue
            parent = ".".join(parts[: len(parts) - (node.level - 1)])
            base = f"{parent}.{base}" if base else parent
        for alias in node.names:
            if alias.name != "*":
                found.append((base, alias.name, alias.asname or alias.name))
    return found


def _later_copies(sites: list[_Site], modules_before: set[int]) -> list[_Site]:
    """Sites for the replacements that modules imported while applied copied with
    ``from <patched module> import <name>``: found from their import statements (not from object
    identity, which would also catch a module that imported the replacement from megatron_npu
    itself). Follows re-exports between such modules; skips :data:`_BELOW_MEGATRON`."""
    copied: dict[tuple[str, str], _Site] = {
        (site.owner.__name__, site.name): site
        for site in sites
        if inspect.ismodule(site.owner)
        and site.original is not _MISSING
        and _rebindable(site.owner, site.original)
    }
    if not copied:
        return []
    fresh = [
        module
        for modname, module in list(sys.modules.items())
        if module is not None
        and id(module) not in modules_before
        and inspect.ismodule(module)
        and modname.partition(".")[0] not in _BELOW_MEGATRON
    ]
    imports = {id(module): _import_froms(module) for module in fresh}
    found: list[_Site] = []
    changed = True
    while changed:  # a module may re-export a copy another fresh module then imports
        changed = False
        for module in fresh:
            namespace = vars(module)
            for base, name, key in imports[id(module)]:
                source = copied.get((base, name))
                if source is None or (module.__name__, key) in copied:
                    continue
                if namespace.get(key) is not source.installed:
                    continue
                site = _Site(module, key, source.original, source.installed)
                copied[(module.__name__, key)] = site
                found.append(site)
                changed = True
    return found


def _split_ids(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def disable_requests(disable: Iterable[str] = ()) -> list[tuple[list[str], str]]:
    """(ids, reason) for each way of switching patches off: ``disable``, ``--disable-patch``
    and ``$MEGATRON_NPU_DISABLE``, as asked (unchecked: :func:`disabled_patches` checks them)."""
    return [
        (list(disable), "disabled by apply(disable=...)"),
        (_split_ids(os.environ.get(DISABLE_FLAG_ENV, "")), f"disabled by {DISABLE_FLAG}"),
        (_split_ids(os.environ.get(DISABLE_ENV, "")), f"disabled by {DISABLE_ENV}"),
    ]


def disabled_patches(disable: Iterable[str] = (), known: Iterable[str] = ()) -> dict[str, str]:
    """Patch id -> reason, for every patch switched off by ``disable``, ``--disable-patch`` or
    ``$MEGATRON_NPU_DISABLE``; raise :class:`UnknownPatchError` naming an id not in ``known``."""
    known_ids = set(known)
    reasons: dict[str, str] = {}
    for ids, reason in disable_requests(disable):
        for patch_id in ids:
            if patch_id not in known_ids:
                raise UnknownPatchError(
                    f"cannot disable patch {patch_id!r} ({reason.removeprefix('disabled by ')}): "
                    "no patch has that id; 'megatron-npu info' lists the ids"
                )
            reasons.setdefault(patch_id, reason)
    return reasons


def plan_status(patch: Patch, device: str, version: str) -> tuple[str, str]:
    """Status a patch would get before touching anything: (status, reason) or (None, '')."""
    if device not in patch.devices:
        return NOT_FOR_DEVICE, f"applies to {', '.join(sorted(patch.devices))}; device is {device}"
    if not patch.applies_to_version(version):
        return (
            SKIPPED_BY_VERSION,
            f"megatron-core {version} is outside {patch.versions!r}",
        )
    if patch.requires and not _importable(patch.requires):
        return (
            NOT_INSTALLED,
            f"{patch.requires} is not importable here (Megatron-LM's training layer is not on "
            "sys.path); the patch applies when it is",
        )
    return "", ""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def apply(
    device: str | None = None,
    *,
    strict: bool = True,
    patches: list[Patch] | None = None,
    megatron_version: str | None = None,
    disable: Iterable[str] = (),
    transfer: bool = False,
) -> list[PatchResult]:
    """Activate ``device`` (auto-detected if None) and install its patches.

    Idempotent for the same device, patch list and disabled set; otherwise the previous patches
    are restored first. With ``strict`` (the default) any failure restores everything and raises;
    otherwise failures are recorded with status ``failed``. Patches named in ``disable`` (or in
    ``$MEGATRON_NPU_DISABLE`` / ``--disable-patch``) are not installed. ``transfer=True`` adds
    transparent mode (:mod:`megatron_npu.transfer`): CUDA spellings in *any* code, the user's
    script included, mean ``device``.
    """
    from megatron_npu import devices

    with _lock:
        dev = devices.resolve(device)
        patch_list = all_patches() if patches is None else list(patches)
        known = {p.id for p in all_patches()} | {p.id for p in patch_list}
        off = disabled_patches(disable, known)
        ids = tuple(p.id for p in patch_list) + tuple(f"-{i}" for i in sorted(off))
        ids += ("+transfer",) if transfer else ()
        if _state.device == dev.name and _state.patch_ids == ids:
            return list(_state.results)
        if _state.device is not None:
            restore()
        version = megatron_version or megatron_core_version()
        modules_before = {id(m) for m in list(sys.modules.values())}
        devices.activate(dev)
        results: list[PatchResult] = []
        sites: list[_Site] = []
        errors: list[PatchError] = []
        lacking: dict[str, list[str]] = {}  # patch id -> kernels the device lacks
        _state.device, _state.patch_ids, _state.sites, _state.results = (
            dev.name,
            ids,
            sites,
            results,
        )
        _state.modules_before = modules_before
        _state.call = dict(
            device=dev,
            strict=strict,
            patches=patches,
            megatron_version=megatron_version,
            disable=tuple(disable),
            transfer=transfer,
        )
        try:  # from here on, anything that escapes (even KeyboardInterrupt) undoes it all
            wanted = [
                p
                for p in patch_list
                if p.id not in off and not plan_status(p, dev.name, version)[0]
            ]
            copies = _copy_index(_rebind_candidates(wanted))
            for patch in patch_list:
                status, reason = plan_status(patch, dev.name, version)
                if patch.id in off:
                    status, reason = DISABLED, off[patch.id]
                if status:
                    results.append(PatchResult(patch.id, patch.target, status, reason))
                    continue
                missing = dev.missing_kernels(patch.npu_kernels)
                if missing:
                    error = MissingKernelError(
                        missing_kernel_message({patch.id: missing}, dev.kernels_source)
                    )
                    lacking[patch.id] = missing
                    errors.append(error)
                    results.append(PatchResult(patch.id, patch.target, FAILED, str(error)))
                    continue
                before = len(sites)
                try:
                    planned = _plan(patch, copies)
                    _install(planned, sites)
                except Exception as exc:  # noqa: BLE001  (every failure becomes a PatchError)
                    _uninstall(sites[before:])
                    del sites[before:]
                    error = _as_patch_error(patch, exc, version)
                    error.__cause__ = exc
                    errors.append(error)
                    results.append(PatchResult(patch.id, patch.target, FAILED, str(error)))
                    continue
                if not planned:
                    kept = _state.originals[patch.id]
                    results.append(
                        PatchResult(
                            patch.id,
                            patch.target,
                            KEPT_ORIGINAL,
                            f"the target stays as found ({_qualified_name(kept)}); the patch "
                            f"is for: {patch.reason}",
                        )
                    )
                    continue
                results.append(
                    PatchResult(patch.id, patch.target, APPLIED, patch.reason, len(sites) - before)
                )
            if errors and strict:
                if len(lacking) == len(errors):  # one line for every kernel the device lacks
                    raise MissingKernelError(missing_kernel_message(lacking, dev.kernels_source))
                if len(errors) == 1:
                    raise errors[0]
                raise PatchError("; ".join(str(e) for e in errors))
            if transfer:
                from megatron_npu import transfer as transfer_mode

                transfer_mode.install(dev)
        except BaseException:
            restore()
            raise
        return list(results)


def restore() -> None:
    """Put back every original object and deactivate the device.

    Besides the sites apply() bound, copies that modules imported since then made with
    ``from <patched module> import <name>`` are put back too (:func:`_later_copies`)."""
    from megatron_npu import devices, transfer

    with _lock:
        transfer.uninstall()
        later = _later_copies(_state.sites, _state.modules_before) if _state.sites else []
        _uninstall(later)
        _uninstall(_state.sites)
        if _state.device is not None:
            devices.deactivate()
        _state.device, _state.patch_ids, _state.sites, _state.results = None, (), [], []
        _state.originals, _state.modules_before, _state.call = {}, set(), None


@contextlib.contextmanager
def applied_for(device: Any = None, **kwargs: Any) -> Iterator[list[PatchResult]]:
    """``apply(device, **kwargs)`` for the block, then the process as it was: restored if nothing
    was applied before, else the previous application (same arguments) re-established."""
    with _lock:
        previous = dict(_state.call) if _state.call is not None else None
        try:
            yield apply(device, **kwargs)
        finally:
            restore()
            if previous is not None:
                apply(**previous)


def original(patch: Patch) -> Any:
    """The pristine object ``patch`` replaces (what Megatron itself would run)."""
    if patch.id in _state.originals:
        return _state.originals[patch.id]
    owner, name = resolve(patch.target)
    return _unwrap_descriptor(_raw_attribute(owner, name)[0])[0]


def active_device() -> str | None:
    return _state.device


def results() -> list[PatchResult]:
    return list(_state.results)
