"""torch_npu's own kernel schemas: what a call to a real ``torch_npu.npu_*`` kernel must look like.

``torch_npu_schemas.txt`` beside this module holds, one per line, the ``func:`` schema of every
``npu_*`` kernel and overload of the pinned torch_npu release, copied verbatim from
``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` in its wheel (the file
:mod:`megatron_npu.devices.torch_npu_wheel` writes, and a test holds equal to the wheel). Its
header names the release; ``pyproject.toml``'s ``npu`` extra pins the same one.

A schema is turned into the Python signature torch_npu's binding exposes by PyTorch's own code
generator (``torchgen``, the generator torch_npu's bindings are built with): ``self`` is called
``input``, ``.out`` overloads take their outputs as one keyword ``out=``, a ``*`` makes the
parameters after it keyword-only, and an optional parameter without a default is still required.
:func:`bind` checks a call against that signature and the declared argument types, so a call that
would not bind on the real kernel fails here, on any machine, with :class:`KernelCallError`.
The ``npu-emulated`` device runs every kernel call through it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import numbers
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

SCHEMA_FILE = "torch_npu_schemas.txt"
#: header keys of :data:`SCHEMA_FILE` (``# key: value`` lines before the schemas)
HEADER_KEYS = ("torch_npu", "wheel", "sha256", "source", "build_branch")


class KernelCallError(TypeError):
    """A call that torch_npu's binding of the kernel would reject."""


class UnknownKernelError(KernelCallError):
    """A kernel name the pinned torch_npu does not have."""


@dataclass(frozen=True)
class Overload:
    """One overload of a kernel: its native schema line and the Python signature it binds to."""

    schema: str
    signature: inspect.Signature
    #: torchgen's type of each Python parameter but the outputs, by name
    types: dict[str, Any]
    #: the keyword that takes the output tensors (``out``, or the one output's own name)
    out_name: str | None
    outputs: int
    returns: int

    @property
    def has_out(self) -> bool:
        return self.out_name is not None


@dataclass(frozen=True)
class SchemaFile:
    header: dict[str, str]
    lines: tuple[str, ...]

    @property
    def version(self) -> str:
        return self.header["torch_npu"]


def parse_schema_file(text: str) -> SchemaFile:
    header: dict[str, str] = {}
    lines = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            key, sep, value = line[1:].partition(":")
            if sep and key.strip() in HEADER_KEYS:
                header[key.strip()] = value.strip()
            continue
        lines.append(line)
    missing = [k for k in HEADER_KEYS if k not in header]
    if missing:
        raise ValueError(f"{SCHEMA_FILE}: header lacks {', '.join(missing)}")
    return SchemaFile(header, tuple(lines))


@functools.lru_cache(maxsize=1)
def schema_file() -> SchemaFile:
    """The committed schema file of the pinned torch_npu."""
    text = resources.files(__package__).joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    return parse_schema_file(text)


def pinned_version() -> str:
    """The torch_npu release the schemas come from (the ``npu`` extra pins the same one)."""
    return schema_file().version


def pinned_requirement() -> str | None:
    """The ``torch_npu`` version the installed megatron-npu's ``npu`` extra pins, if any."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("megatron-npu") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for text in requires:
        req = Requirement(text)
        if req.name.replace("-", "_") == "torch_npu" and req.marker is not None:
            if req.marker.evaluate({"extra": "npu"}):
                pins = [s.version for s in req.specifier if s.operator == "=="]
                return pins[0] if pins else None
    return None


def kernel_name(schema: str) -> str:
    """``npu_foo`` of ``npu_foo.overload(...) -> ...``."""
    return schema.split("(", 1)[0].split(".", 1)[0]


@functools.lru_cache(maxsize=1)
def _lines_by_kernel() -> dict[str, tuple[str, ...]]:
    grouped: dict[str, list[str]] = {}
    for line in schema_file().lines:
        grouped.setdefault(kernel_name(line), []).append(line)
    return {name: tuple(lines) for name, lines in grouped.items()}


def kernel_names() -> frozenset[str]:
    """Every ``npu_*`` kernel the pinned torch_npu has."""
    return frozenset(_lines_by_kernel())


def has_kernel(name: str) -> bool:
    return name in _lines_by_kernel()


def python_overload(schema: str) -> Overload:
    """The Python signature torch_npu's binding gives ``schema`` (torchgen's own rules)."""
    from torchgen.api.python import signature_from_schema
    from torchgen.model import FunctionSchema

    parsed = FunctionSchema.parse(schema)
    sig = signature_from_schema(parsed, category_override=None, method=False, pyi=True)
    stub = sig.signature_str_pyi(skip_outputs=False)
    namespace: dict[str, Any] = {}
    # annotations stay strings (never evaluated); defaults are plain Python literals
    exec(
        compile(stub.replace(": ...", ": pass"), schema, "exec", flags=_FUTURE_ANNOTATIONS),
        namespace,
    )
    signature = inspect.signature(namespace[str(parsed.name.name)])
    ordered = list(sig.input_args) + list(sig.input_kwargs) + list(sig.tensor_options_args)
    out = sig.output_args
    out_name = out.name if out is not None else None
    names = [p for p in signature.parameters if p != out_name]
    if len(names) != len(ordered):
        raise ValueError(f"cannot line up the Python parameters of {schema!r}")
    types = {name: arg.type for name, arg in zip(names, ordered, strict=True)}
    outputs = len(out.outputs) if out is not None else 0
    return Overload(schema, signature, types, out_name, outputs, len(parsed.returns))


_FUTURE_ANNOTATIONS = __import__("__future__").annotations.compiler_flag


@functools.cache
def overloads(name: str) -> tuple[Overload, ...]:
    """Every overload of kernel ``name`` in the pinned torch_npu (UnknownKernelError if none)."""
    lines = _lines_by_kernel().get(name)
    if not lines:
        raise UnknownKernelError(
            f"torch_npu.{name} does not exist in torch_npu {pinned_version()} (the release the "
            "adaptor's kernel calls are checked against)"
        )
    return tuple(python_overload(line) for line in lines)


# ---------------------------------------------------------------------------------- types


def _is_int(value: Any) -> bool:
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)) or isinstance(
        value, torch.SymInt
    )


def _accepts(t: Any, value: Any) -> bool:
    """Whether torch's argument parser takes ``value`` for torchgen type ``t``."""
    from torchgen.model import BaseTy, BaseType, ListType, OptionalType

    if isinstance(t, OptionalType):
        return value is None or _accepts(t.elem, value)
    if isinstance(t, ListType):
        if t.size is not None and _is_int(value) and _accepts(t.elem, value):
            return True  # int[N] takes one int for all N entries
        if isinstance(value, torch.Size):
            return isinstance(t.elem, BaseType) and t.elem.name in (BaseTy.int, BaseTy.SymInt)
        if not isinstance(value, (list, tuple)):
            return False
        if t.size is not None and len(value) != t.size:
            return False
        return all(_accepts(t.elem, v) for v in value)
    name = t.name if isinstance(t, BaseType) else None
    checks = {
        BaseTy.Tensor: lambda v: isinstance(v, torch.Tensor),
        BaseTy.int: _is_int,
        BaseTy.SymInt: _is_int,
        BaseTy.float: lambda v: isinstance(v, numbers.Real),
        BaseTy.bool: lambda v: isinstance(v, bool),
        BaseTy.str: lambda v: isinstance(v, str),
        BaseTy.Scalar: lambda v: (
            isinstance(v, numbers.Number) or (isinstance(v, torch.Tensor) and v.numel() == 1)
        ),
        BaseTy.ScalarType: lambda v: isinstance(v, torch.dtype),
        BaseTy.Layout: lambda v: isinstance(v, torch.layout),
        BaseTy.MemoryFormat: lambda v: isinstance(v, torch.memory_format),
        BaseTy.Device: lambda v: isinstance(v, (torch.device, str, int)),
        BaseTy.Generator: lambda v: isinstance(v, torch.Generator),
    }
    check = checks.get(name)
    return True if check is None else check(value)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)}"
    return type(value).__name__


def python_form(overload: Overload, name: str) -> str:
    """``npu_foo(input, *, approximate='none')``: the call as the binding's Python sees it."""
    params = [
        p.replace(annotation=inspect.Parameter.empty)
        for p in overload.signature.parameters.values()
    ]
    return f"{name}{inspect.Signature(params)}"


def _bind_one(overload: Overload, args: tuple, kwargs: dict) -> str | None:
    """None when the call binds to ``overload``, else why not."""
    out_name = overload.out_name or "out"
    if (out_name in kwargs) != overload.has_out:
        return f"takes {out_name}=" if overload.has_out else "has no out= form"
    params = overload.signature.parameters
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        return f"no parameter named {', '.join(map(repr, unknown))}"
    positional = [
        p.name for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    if len(args) > len(positional):
        keyword_only = [
            p.name
            for p in params.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != out_name
        ]
        extra = f"; keyword-only: {', '.join(keyword_only)}" if keyword_only else ""
        return f"{len(args)} positional arguments, but it takes {len(positional)}{extra}"
    try:
        bound = overload.signature.bind(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    for name, value in bound.arguments.items():
        if name == out_name:
            outs = [value] if isinstance(value, torch.Tensor) else value
            if (
                not isinstance(outs, (list, tuple))
                or len(outs) != overload.outputs
                or not all(isinstance(t, torch.Tensor) for t in outs)
            ):
                return f"{out_name}= must be {overload.outputs} tensor(s), got {_describe(value)}"
            continue
        if not _accepts(overload.types[name], value):
            return f"{name} is {overload.types[name]}, got {_describe(value)}"
    return None


def bind(name: str, args: tuple, kwargs: dict) -> None:
    """Raise :class:`KernelCallError` unless ``torch_npu.<name>(*args, **kwargs)`` binds to one
    of the kernel's overloads in the pinned torch_npu, by the binding's own rules (positional
    and keyword-only parameters, required ones, ``out=``, declared argument types)."""
    candidates = overloads(name)
    reasons = []
    for overload in candidates:
        reason = _bind_one(overload, args, kwargs)
        if reason is None:
            return
        reasons.append(f"{python_form(overload, name)}: {reason}")
    raise KernelCallError(
        f"torch_npu.{name} call would not bind on torch_npu {pinned_version()}: "
        + "; ".join(reasons)
    )


def returns(name: str, *, out: bool = False) -> int:
    """How many values the kernel returns (of its ``out=`` form when ``out``)."""
    for overload in overloads(name):
        if overload.has_out == out:
            return overload.returns
    raise KernelCallError(f"torch_npu.{name} has no {'out= ' if out else ''}form")


def missing_kernel_message(lacking: dict[str, list[str]], source: str | None) -> str:
    """The one line that refuses patches whose NPU path calls kernels the device lacks
    (``lacking``: patch id -> kernels; ``source`` says what the device's kernel module is,
    e.g. ``torch_npu 2.12.0``)."""
    kernels = sorted({k for names in lacking.values() for k in names})
    return (
        f"{source or 'the torch_npu in use'} does not have "
        f"{', '.join('torch_npu.' + k for k in kernels)}, which the adaptor's "
        f"{', '.join(map(repr, lacking))} patch{'es' if len(lacking) > 1 else ''} call; its "
        f"kernel calls are checked against torch_npu {pinned_version()} (see the README's "
        f"torch_npu section): install that release, or switch "
        f"{'them' if len(lacking) > 1 else 'it'} off with "
        f"MEGATRON_NPU_DISABLE={','.join(lacking)}"
    )
