"""The GPT data pipeline: tokenizers, preprocessing to Megatron's indexed format, compiler-free
index helpers, an embedded default corpus and dataset building.

Submodules are imported on first use of a name below (megatron-core is heavy to import). The
``preprocess`` function is not re-exported here because it shares its name with its submodule:
use ``from megatron_npu.data.preprocess import preprocess``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_tokenizer": "tokenizers",
    "ByteLevelTokenizer": "tokenizers",
    "GPT2BPETokenizer": "tokenizers",
    "BertWordPieceTokenizer": "tokenizers",
    "TOKENIZER_TYPES": "tokenizer_types",
    "TokenizerError": "tokenizers",
    "add_preprocess_args": "preprocess",
    "run_preprocess": "preprocess",
    "PreprocessError": "preprocess",
    "install_numpy_helpers": "index_helpers",
    "restore_helpers": "index_helpers",
    "numpy_helpers": "index_helpers",
    "build_default_corpus": "corpus",
    "build_gpt_datasets": "datasets",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
