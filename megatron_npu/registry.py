"""The patch registry: one declarative entry per replaced Megatron object.

Each :class:`Patch` names its target by dotted path, the megatron-core versions and devices it
applies to, whether it replaces or wraps the original, and a one-line reason. Patch entries live in
the modules of :mod:`megatron_npu.patches` (one module per area, each exposing ``PATCHES``); this
module only collects them. ``info`` output, tests and reports are generated from
:func:`all_patches`, never from hand-written lists.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from megatron_npu.devices.facts import DEVICES, NON_CUDA

KINDS = ("replace", "wrap")


@dataclass(frozen=True)
class Patch:
    """One replacement of a Megatron (or torch) object.

    ``replacement`` is the new object for ``kind="replace"``; for ``kind="wrap"`` it is a function
    ``original -> new object`` that is always handed the pristine original, so wrappers never stack.
    ``versions`` is a PEP 440 specifier on the installed megatron-core version ("" means any).
    ``parity`` is the patch's parity case (see :mod:`parity`); ``parity_exempt`` the written reason
    when a patch has none, and ``exempt_test`` the pytest node id (``path::test[param]``) of
    the test that fails when this patch is disabled (the parity gate runs it with
    ``MEGATRON_NPU_DISABLE=<id>``). ``npu_kernels`` names the torch_npu kernels the
    replacement calls on the NPU; empty means it runs the same code on the NPU as on the CPU.
    ``benchmark`` is the patch's benchmark case (``"module:NAME"``, see :mod:`perf`);
    ``benchmark_exempt`` the written reason when it has none (pure plumbing).
    ``requires`` names the module outside megatron-core that holds the target (in Megatron-LM's
    training layer, ``megatron.training.*`` / ``megatron.legacy.*``, which the megatron-core wheel
    does not ship): where it is not importable (no Megatron-LM on the path, or a partial
    stand-in ``megatron.training``) the patch is ``not-installed``, never an error.
    ``creates`` marks a target Megatron binds only when an optional CUDA extension imports (a
    module global such as ``fused_weight_gradient_mlp_cuda``): the patch installs it whether or
    not it exists, and restore removes what it created. Nothing else is ever created.
    ``builds`` names (dotted) the adaptor classes a factory replacement returns in place of the
    target's (``WrappedTorchNorm.__new__`` returns megatron-npu's ``Norm``): a module of such a
    class reaches this patch, which a dump that names modules by their class needs to know.
    """

    id: str
    target: str
    replacement: Any
    reason: str
    kind: str = "replace"
    versions: str = ""
    devices: frozenset[str] = NON_CUDA
    check_signature: bool = True
    parity: Any = None
    parity_exempt: str = ""
    benchmark: str = ""
    benchmark_exempt: str = ""
    exempt_test: str = ""
    npu_kernels: tuple[str, ...] = ()
    rebind_copies: bool = True
    requires: str = ""
    creates: bool = False
    builds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"patch {self.id!r}: kind must be one of {KINDS}, got {self.kind!r}")
        unknown = set(self.devices) - DEVICES
        if unknown:
            raise ValueError(f"patch {self.id!r}: unknown devices {sorted(unknown)}")
        if "." not in self.target:
            raise ValueError(f"patch {self.id!r}: target {self.target!r} is not a dotted path")
        try:
            SpecifierSet(self.versions)
        except InvalidSpecifier as exc:
            raise ValueError(f"patch {self.id!r}: bad version specifier {self.versions!r}") from exc
        if self.parity_exempt and not self.exempt_test:
            raise ValueError(f"patch {self.id!r}: a parity exemption must name its exempt_test")
        if self.requires and not self.target.startswith(self.requires + "."):
            raise ValueError(
                f"patch {self.id!r}: target {self.target!r} is not in {self.requires!r}"
            )
        if self.creates and self.kind != "replace":
            raise ValueError(f"patch {self.id!r}: a created target has no original to wrap")
        if self.kind == "wrap" and not callable(self.replacement):
            raise ValueError(f"patch {self.id!r}: a wrap patch needs a callable original -> new")

    @property
    def exercises_npu_kernel(self) -> bool:
        """True when the NPU path calls a torch_npu kernel, False when it is the CPU's code."""
        return bool(self.npu_kernels)

    def applies_to_version(self, version: str) -> bool:
        return SpecifierSet(self.versions).contains(version, prereleases=True)

    def build(self, original: Any) -> Any:
        """The object to install in place of ``original``."""
        return self.replacement(original) if self.kind == "wrap" else self.replacement


def _patch_modules() -> list[str]:
    import megatron_npu.patches as pkg

    return sorted(
        f"{pkg.__name__}.{info.name}"
        for info in pkgutil.iter_modules(pkg.__path__)
        if not info.name.startswith("_")
    )


def all_patches() -> list[Patch]:
    """Every registered patch, in a stable order (patch module name, then declaration order)."""
    patches: list[Patch] = []
    seen: dict[str, str] = {}
    for modname in _patch_modules():
        module = importlib.import_module(modname)
        for patch in getattr(module, "PATCHES", ()):
            if patch.id in seen:
                raise ValueError(
                    f"duplicate patch id {patch.id!r} in {modname} and {seen[patch.id]}"
                )
            seen[patch.id] = modname
            patches.append(patch)
    return patches


def get_patch(patch_id: str) -> Patch:
    for patch in all_patches():
        if patch.id == patch_id:
            return patch
    raise KeyError(f"no patch with id {patch_id!r}")
