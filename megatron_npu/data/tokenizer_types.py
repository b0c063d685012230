"""The ``--tokenizer-type`` names :func:`megatron_npu.data.tokenizers.build_tokenizer` builds.

Kept apart from the tokenizers, which subclass megatron-core's abstract tokenizer, so that
argument parsers (``train``'s launcher, ``preprocess``) list them without importing megatron-core.
"""

from __future__ import annotations

TOKENIZER_TYPES = ("ByteLevel", "GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase")
