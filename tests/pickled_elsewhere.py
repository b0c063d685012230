"""Checkpoints pickled where other modules were installed, and torch's process-wide safe
globals, for the tests of what a ``weights_only`` load admits."""

from __future__ import annotations

import contextlib
import sys
import types

import torch


def install_module(monkeypatch, module: str, name: str) -> type:
    """A module ``module`` (and its packages) holding a class that pickles as ``module.name``;
    returns the class. monkeypatch takes them away again."""
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):  # pickle imports the module and its packages
        package = ".".join(parts[:depth])
        if package not in sys.modules:
            monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
    cls = type(name, (), {"__module__": module, "__qualname__": name})
    setattr(sys.modules[module], name, cls)
    return cls


@contextlib.contextmanager
def registered_elsewhere(*globals_: object):
    """``globals_`` registered process-wide, as another library would; torch's safe globals are
    as they were before when the context ends."""
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(list(globals_))
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
