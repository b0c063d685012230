"""One typed model per file the tools write, used by the writer and by every reader.

Each module here holds one file format as a pydantic model: its fields, their types and what
they mean. The writer builds the model and writes it with :meth:`.base.Document.write`; every
reader (compare, locate, reports, the tests) parses the file with :meth:`.base.Document.read`,
which names the file and the field when the file does not fit. The JSON Schema of each format
in ``docs/schemas/`` is generated from the model (``python -m megatron_npu.formats
docs/schemas``); ``tests/test_file_formats.py`` fails when it is stale.

pydantic, not msgspec: megatron-core's training layer (Megatron-LM's ``megatron.training``)
already depends on it, so a user's environment has it; its ``model_json_schema`` writes the
draft 2020-12 schema with each field's description; and its validation errors carry the field's
location, which the named errors need. msgspec is faster, but these files are small and read a
handful of times per command, and it would be one more dependency.
"""

from __future__ import annotations

import importlib
import json
import pkgutil

from megatron_npu.formats.base import Document, FieldError, FormatError

__all__ = ["Document", "FieldError", "FormatError", "formats", "schema_files"]


def formats() -> dict[str, type[Document]]:
    """Every file format, by the name of its schema file in ``docs/schemas/``: the models each
    module of this package lists in its ``DOCUMENTS``."""
    found: dict[str, type[Document]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for model in getattr(module, "DOCUMENTS", ()):
            if model.schema_name in found:
                raise ValueError(f"two formats named {model.schema_name!r}")
            found[model.schema_name] = model
    return found


def schema_files() -> dict[str, str]:
    """``{file name: text}`` of ``docs/schemas/``: each format's JSON Schema."""
    return {
        f"{name}.schema.json": json.dumps(model.json_schema(), indent=2) + "\n"
        for name, model in formats().items()
    }
