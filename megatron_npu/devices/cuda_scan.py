"""Which modules of an installed package use CUDA directly: the input of device routing.

:func:`cuda_using_modules` reads the package's source files (it imports nothing) and lists the
modules that spell ``torch.cuda``, a ``"cuda"`` / ``"cuda:N"`` device string or ``pin_memory=True``
(page-locked host memory exists only beside an accelerator: a host-only torch has no allocator
for it, so those factories need the routed namespace too), and whether each
binds ``torch`` as a global (what :mod:`megatron_npu.patches.device_namespace` replaces). A text
scan, not an AST walk, so every process can afford it (a few hundred files in tens of
milliseconds); a mention in a comment or docstring counts too, which only routes a module that
did not strictly need it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Iterable, Mapping

_CUDA = re.compile(rb"\btorch\.cuda\b|[\"']cuda(?::\d+)?[\"']|\bpin_memory\s*=\s*True\b")
_IMPORTS_TORCH = re.compile(rb"^\s*import torch\s*(?:#.*)?$", re.MULTILINE)


@functools.cache
def cuda_using_modules(package: str = "megatron.core") -> dict[str, bool]:
    """``{module name: binds torch as a global}`` for every module of ``package`` whose source
    uses CUDA directly; empty if the package is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return {}
    found: dict[str, bool] = {}
    for location in spec.submodule_search_locations:
        for folder, subdirs, files in os.walk(location):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            for filename in sorted(files):
                if not filename.endswith(".py"):
                    continue
                path = os.path.join(folder, filename)
                with open(path, "rb") as handle:
                    source = handle.read()
                if (b"cuda" not in source and b"pin_memory" not in source) or not _CUDA.search(
                    source
                ):
                    continue
                parts = os.path.relpath(path, location)[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join([package, *parts])] = bool(_IMPORTS_TORCH.search(source))
    return dict(sorted(found.items()))


def _under(module: str, prefixes: Iterable[str]) -> str | None:
    """The longest of ``prefixes`` that is ``module`` or a package holding it."""
    best = None
    for prefix in prefixes:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best or ""):
            best = prefix
    return best


def classify(
    modules: Mapping[str, bool], routed: Iterable[str], not_routed: Mapping[str, str]
) -> tuple[list[str], dict[str, str], list[str]]:
    """Split CUDA-using ``modules`` into (routed, not routed with the reason, unclassified).

    A module is routed when it lies under one of ``routed`` (packages or modules), binds ``torch``
    and no more specific ``not_routed`` entry covers it; ``not_routed`` maps packages or modules
    to why they stay unrouted. Whatever is left is unclassified: CUDA use nobody decided about.
    """
    routed = tuple(routed)
    chosen, skipped, unclassified = [], {}, []
    for module, binds_torch in modules.items():
        scope, exempt = _under(module, routed), _under(module, not_routed)
        if exempt is not None and (scope is None or len(exempt) >= len(scope)):
            skipped[module] = not_routed[exempt]
        elif scope is not None and binds_torch:
            chosen.append(module)
        else:
            unclassified.append(module)
    return chosen, skipped, unclassified
