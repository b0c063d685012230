"""Build megatron-core GPT train/valid/test datasets on CPU or NPU, with or without
``torch.distributed``.

:func:`build_gpt_datasets` wraps megatron-core's ``GPTDatasetConfig`` + ``GPTDataset`` (or
``MockGPTDataset``) + ``BlendedMegatronDatasetBuilder`` and builds the indices with the numpy
helpers of :mod:`megatron_npu.data.index_helpers` (installed for the duration of the build unless
they already are), so no compiled ``helpers_cpp`` is needed.

Notes on megatron-core 0.16.1 behaviour this module accounts for:

* Without ``torch.distributed`` initialised every split is built in this process. With it, rank 0
  builds and caches the indices first, then every other rank loads them after a barrier (so the
  cache directory must be shared by the ranks); ``is_built_on_rank`` is ``lambda: True``.
* ``BlendedDataset`` calls ``torch.distributed.get_rank()`` unguarded when a cache path is set
  and its cache misses, which fails when ``torch.distributed`` is not initialised. For a weighted
  blend built without ``torch.distributed`` a given ``path_to_cache`` is therefore not passed to
  megatron-core (a warning says so): the GPTDataset indices are then cached in megatron's default
  place, ``<prefix>/cache/GPTDataset_indices``, and the blend indices are not cached.
* With ``path_to_cache=None`` megatron caches GPTDataset indices in
  ``<prefix>/cache/GPTDataset_indices`` (mock datasets are never cached). Cache directories are
  created 0750 here and the files megatron writes into them are set to 0640 after the build.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from megatron_npu.data.index_check import check_indexed_dataset
from megatron_npu.data.index_helpers import numpy_helpers
from megatron_npu.files import DIR_MODE, FILE_MODE, make_dir

__all__ = ["build_gpt_datasets", "parse_data_path"]

logger = logging.getLogger(__name__)


def parse_data_path(
    data_path: Sequence[str | float | os.PathLike] | str | os.PathLike,
) -> tuple[list[str], list[float] | None]:
    """Megatron ``--data-path``: ``[prefix, ...]`` or ``[w1, prefix1, w2, prefix2, ...]``.

    Returns ``(prefixes, weights or None)`` as megatron-core's ``get_blend_from_list`` does.
    """
    from megatron.core.datasets.utils import get_blend_from_list

    if isinstance(data_path, (str, os.PathLike)):
        data_path = [data_path]
    items = [os.fspath(x) if isinstance(x, os.PathLike) else str(x) for x in data_path]
    if not items:
        raise ValueError("data_path is empty")
    prefixes, weights = get_blend_from_list(items)
    return list(prefixes), (None if weights is None else [float(w) for w in weights])


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _secure_tree(root: str) -> None:
    """Files 0640 and directories 0750 below ``root``, for what this user owns."""
    if not os.path.isdir(root):
        return
    uid = os.getuid()
    for directory, _subdirs, files in os.walk(root):
        entries = [(directory, DIR_MODE)] + [(os.path.join(directory, f), FILE_MODE) for f in files]
        for path, mode in entries:
            try:
                if os.stat(path).st_uid == uid:
                    os.chmod(path, mode)
            except OSError:
                pass


def build_gpt_datasets(
    data_path: Sequence[str | float | os.PathLike] | str | os.PathLike | None,
    seq_length: int,
    seed: int,
    tokenizer: Any,
    train_samples: int,
    valid_samples: int = 0,
    test_samples: int = 0,
    split: str = "100,0,0",
    mock: bool = False,
    *,
    path_to_cache: str | os.PathLike | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
    use_numpy_helpers: bool = True,
    **config_kwargs: Any,
) -> tuple[Any, Any, Any]:
    """Build the (train, valid, test) GPT datasets; a split is None when it gets no data.

    Args:
        data_path: Megatron-style ``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]`` (a single
            prefix string is accepted too). Ignored when ``mock``.
        seq_length: tokens per sample (each sample has ``seq_length + 1`` tokens of text).
        seed: random seed of the document and sample shuffles.
        tokenizer: a :mod:`megatron_npu.data.tokenizers` tokenizer (``eod``, ``vocab_size``,
            ``unique_identifiers``).
        train_samples, valid_samples, test_samples: samples to draw per split (0: one epoch).
        split: Megatron ``--split`` weights, e.g. ``"969,30,1"``; forced to ``"1,1,1"`` by
            megatron-core when ``mock``.
        mock: build ``MockGPTDataset`` (synthetic tokens) instead of reading ``data_path``.
        path_to_cache: where megatron-core caches the indices (see the module notes).
        use_numpy_helpers: build indices with :mod:`megatron_npu.data.index_helpers`.
        config_kwargs: further ``GPTDatasetConfig`` fields.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    sizes = [int(train_samples), int(valid_samples), int(test_samples)]
    if any(s < 0 for s in sizes):
        raise ValueError(f"sample counts must be >= 0, got {sizes}")

    if mock:
        blend = None
        prefixes: list[str] = []
    else:
        if data_path is None:
            raise ValueError("data_path is required unless mock=True")
        prefixes, weights = parse_data_path(data_path)
        prefixes = [os.path.abspath(p) for p in prefixes]
        missing = [p for p in prefixes if not IndexedDataset.exists(p)]
        if missing:
            raise FileNotFoundError(
                "no indexed dataset (.bin + .idx) at prefix(es): " + ", ".join(missing)
            )
        for prefix in prefixes:  # a named error for a corrupted .idx/.bin, not an index error later
            check_indexed_dataset(prefix, flag="data_path")
        blend = (prefixes, weights)

    distributed = _distributed()
    cache = None if path_to_cache is None else os.path.abspath(os.fspath(path_to_cache))
    if cache is not None and not distributed and len(prefixes) > 1:
        warnings.warn(
            "path_to_cache is not used for a blend built without torch.distributed "
            "(megatron-core's BlendedDataset calls torch.distributed.get_rank() when caching); "
            "GPTDataset indices go to <prefix>/cache/GPTDataset_indices instead",
            RuntimeWarning,
            stacklevel=2,
        )
        cache = None

    builds_here = not distributed or torch.distributed.get_rank() == 0
    cache_roots: list[str] = []
    if not mock:
        if cache is not None:
            cache_roots = [cache]
        else:
            cache_roots = [os.path.join(p, "cache", "GPTDataset_indices") for p in prefixes]
        for root in cache_roots:
            make_dir(root)

    config = GPTDatasetConfig(
        random_seed=int(seed),
        sequence_length=int(seq_length),
        blend=blend,
        split=split,
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        **config_kwargs,
    )
    cls = MockGPTDataset if mock else GPTDataset
    builder = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config)
    if use_numpy_helpers:
        with numpy_helpers():
            train, valid, test = builder.build()
    else:
        train, valid, test = builder.build()

    if builds_here:
        for root in cache_roots:
            _secure_tree(root)
    return train, valid, test
