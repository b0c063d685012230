"""Training data: where the samples come from and which rank reads which.

Sources (exactly one per run):

* ``--mock-data``: Megatron-Core's ``MockGPTDataset`` with a ``NullTokenizer`` of ``--vocab-size``;
* ``--data-path``: indexed datasets through :func:`megatron_npu.data.datasets.build_gpt_datasets`
  with the tokenizer from :func:`megatron_npu.data.tokenizers.build_tokenizer`;
* neither: the embedded default corpus, :func:`megatron_npu.data.corpus.build_default_corpus`
  (stdlib docstrings, byte-level tokenizer), written once by global rank 0.

Who reads what (Megatron's pretraining sampler): step ``i`` consumes global samples
``[i * G, (i + 1) * G)``; each micro-batch round takes the next ``micro_batch x DP`` of them and DP
rank ``r`` gets the ``r``-th slice of ``micro_batch``. Every TP rank of a DP rank reads the same
samples itself (the datasets are deterministic, so no broadcast is needed), and only model chunks
that hold the first or the last pipeline stage read at all: the first needs tokens and position
ids, the last labels and the loss mask. Each such chunk has its own iterator (interleaved
schedules call the chunks' forward steps independently).
"""

from __future__ import annotations

import logging
import os
import tempfile
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state

from megatron_npu import devices
from megatron_npu.training.errors import TrainingInputError


@dataclass
class TrainData:
    dataset: Any  # a torch-style map dataset of Megatron GPT sample dicts
    vocab_size: int  # tokenizer vocabulary (before Megatron's padding)
    source: str  # "mock", "data-path" or "default-corpus"
    description: str
    paths: str = ""  # the --data-path prefixes read (named by the token-id check)


class PretrainingSampler:
    """Megatron-LM's ``MegatronPretrainingSampler``: consecutive global samples, DP-sliced."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left: consumed {consumed_samples} of {total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.round = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.round

    def __iter__(self) -> Iterator[list[int]]:
        start = self.rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - self.round + 1, self.round):
            yield list(range(first + start, first + start + self.micro_batch_size))


def _is_built_on_rank() -> bool:
    return parallel_state.is_pipeline_first_stage(
        ignore_virtual=True
    ) or parallel_state.is_pipeline_last_stage(ignore_virtual=True)


#: No document masks: every sample's attention mask is the plain causal one, which the training
#: loop hands attention itself, so the datasets build none (Megatron's ``create_attention_mask``:
#: a [s, s] mask per sample is 8 MB of host copies per micro-batch of 8 x 1024 tokens, during
#: which a GPU waits).
RESET_ATTENTION_MASK = False


def _gpt_config_kwargs(args: Namespace) -> dict[str, Any]:
    return dict(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        reset_position_ids=False,
        reset_attention_mask=RESET_ATTENTION_MASK,
        eod_mask_loss=False,
        create_attention_mask=RESET_ATTENTION_MASK,
    )


def _mock(args: Namespace, train_samples: int) -> TrainData:
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    from megatron_npu.data.tokenizers import null_tokenizer

    tokenizer = null_tokenizer(args.vocab_size)  # Megatron-LM's vocabulary for --vocab-size
    config = GPTDatasetConfig(tokenizer=tokenizer, split="1,0,0", **_gpt_config_kwargs(args))
    # "Unable to save MockGPTDataset indexes because path_to_cache is None", once per split and
    # rank: mock indices are never cached, so the warning says nothing.
    quiet = logging.getLogger("megatron.core.datasets.gpt_dataset")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        train, _, _ = BlendedMegatronDatasetBuilder(
            MockGPTDataset, [train_samples, None, None], _is_built_on_rank, config
        ).build()
    finally:
        quiet.setLevel(level)
    return TrainData(
        train, tokenizer.vocab_size, "mock", f"MockGPTDataset, vocab {tokenizer.vocab_size}"
    )


def _indexed(
    args: Namespace, train_samples: int, data_path: list[str], tokenizer: Any, source: str
) -> TrainData:
    from megatron_npu.data.datasets import build_gpt_datasets

    # Collective: rank 0 builds and caches the indices, the others load them after a barrier.
    train, _, _ = build_gpt_datasets(
        data_path,
        args.seq_length,
        args.seed,
        tokenizer,
        train_samples,
        split=args.split or "100,0,0",
        path_to_cache=args.data_cache_path,
    )
    if train is None:
        raise RuntimeError(f"no training split was built from {' '.join(data_path)}")
    vocab = int(tokenizer.vocab_size)
    paths = " ".join(data_path)
    return TrainData(train, vocab, source, f"{paths}, vocab {vocab}", paths)


def _data_path(args: Namespace, train_samples: int) -> TrainData:
    from megatron_npu.data.index_check import check_token_ids
    from megatron_npu.data.tokenizers import build_tokenizer
    from megatron_npu.training.preflight import data_prefixes

    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
    for prefix in data_prefixes(list(args.data_path)):  # before the model is built
        check_token_ids(prefix, int(tokenizer.vocab_size))  # larger files: checked per batch
    return _indexed(args, train_samples, list(args.data_path), tokenizer, "data-path")


def default_corpus_dir(args: Namespace) -> str:
    if args.default_corpus_dir:
        return args.default_corpus_dir
    base = args.save or os.path.join(tempfile.gettempdir(), f"megatron-npu-{os.getuid()}")
    return os.path.join(base, "default_corpus")


def _default_corpus(args: Namespace, train_samples: int) -> TrainData:
    """The embedded corpus: written once (global rank 0 first; later calls find the files)."""
    from megatron_npu.data.corpus import build_default_corpus
    from megatron_npu.data.tokenizers import ByteLevelTokenizer

    out_dir = default_corpus_dir(args)
    if torch.distributed.get_rank() == 0:
        build_default_corpus(out_dir)
    torch.distributed.barrier()
    prefix = build_default_corpus(out_dir)
    data = _indexed(args, train_samples, [prefix], ByteLevelTokenizer(), "default-corpus")
    data.description = f"embedded default corpus (stdlib docstrings, byte-level) {data.description}"
    return data


def build_train_data(args: Namespace) -> TrainData:
    """The training split for ``args`` (collective: every rank must call it)."""
    train_samples = args.train_iters * args.global_batch_size
    if args.mock_data:
        return _mock(args, train_samples)
    if args.data_path:
        return _data_path(args, train_samples)
    return _default_corpus(args, train_samples)


def _chunk_reads_data(chunk: torch.nn.Module) -> bool:
    from megatron_npu.training.model import unwrap

    gpt = unwrap(chunk)
    return bool(gpt.pre_process or gpt.post_process)


def pins_batches(device: torch.device) -> bool:
    """Whether the loader stages micro-batches in page-locked host memory for ``device``, as
    Megatron-LM's loader does (``pin_memory=True``). A copy to an accelerator from pageable
    memory waits for the device's queue to drain first (CUDA documents it for every pageable
    host-to-device copy), so each micro-batch would stall the step until the device caught up;
    from page-locked memory the copy is queued behind the work before it. A host-only device
    has nothing to copy to."""
    return device.type != "cpu"


def iterators(
    args: Namespace, data: TrainData, model: list[torch.nn.Module], consumed_samples: int
) -> list[Iterator[dict[str, torch.Tensor]] | None]:
    """One iterator per model chunk (None for chunks that hold neither end of the pipeline),
    its batches pinned for the active device (:func:`pins_batches`)."""
    pin = pins_batches(devices.current_torch_device())
    total = args.train_iters * args.global_batch_size
    out: list[Iterator[dict[str, torch.Tensor]] | None] = []
    for chunk in model:
        if data.dataset is None or not _chunk_reads_data(chunk):
            out.append(None)
            continue
        sampler = PretrainingSampler(
            total_samples=total,
            consumed_samples=consumed_samples,
            micro_batch_size=args.micro_batch_size,
            data_parallel_rank=parallel_state.get_data_parallel_rank(),
            data_parallel_size=parallel_state.get_data_parallel_world_size(),
        )
        # Its own generator: DataLoader draws a base seed when an iterator starts, and from
        # torch's global generator that draw would shift the dropout stream of a resumed run
        # (whose global RNG state was just restored) against the uninterrupted one.
        loader = torch.utils.data.DataLoader(
            data.dataset,
            batch_sampler=sampler,
            num_workers=0,
            pin_memory=pin,
            generator=torch.Generator().manual_seed(args.seed),
        )
        out.append(checked_token_ids(iter(loader), data))
    return out


def context_parallel_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This context-parallel rank's rows of a micro-batch, cut by Megatron's own
    ``get_batch_on_this_cp_rank`` (two of the sequence's 2 x CP chunks, ``r`` and
    ``2 CP - 1 - r``; positions and labels travel with their tokens). No attention mask is cut:
    context-parallel attention is causal or unmasked and does not read one.

    The function's signature is per release: ``(batch)`` up to 0.16, ``cp_group`` from 0.17,
    and from 0.18 a required ``is_hybrid_cp`` (False: one sequence per row, no packed
    documents, so the per-sequence split above), as Megatron-LM's ``pretrain_gpt.py`` of each
    release calls it."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    accepted = inspect.signature(get_batch_on_this_cp_rank).parameters
    options: dict[str, object] = {}
    if "cp_group" in accepted:
        options["cp_group"] = parallel_state.get_context_parallel_group()
    if "is_hybrid_cp" in accepted:
        options["is_hybrid_cp"] = False
    rows = get_batch_on_this_cp_rank(
        {k: v for k, v in batch.items() if k != "attention_mask"}, **options
    )
    return {**batch, **rows}


def checked_token_ids(
    batches: Iterator[dict[str, torch.Tensor]], data: TrainData
) -> Iterator[dict[str, torch.Tensor]]:
    """``batches``, each first checked to hold only ids of the tokenizer's vocabulary (an id
    beyond it would fail deep in the embedding as ``IndexError: index out of range``)."""
    from megatron_npu.data.index_check import OUT_OF_VOCAB_REMEDY, out_of_vocab_message

    for batch in batches:
        for key in ("tokens", "labels"):
            ids = batch.get(key)
            if ids is None or ids.numel() == 0:
                continue
            low, high = int(ids.min()), int(ids.max())
            if high >= data.vocab_size or low < 0:
                raise TrainingInputError(
                    out_of_vocab_message(
                        "--data-path" if data.source == "data-path" else "the training data",
                        data.paths or data.description,
                        high if high >= data.vocab_size else low,
                        data.vocab_size,
                    ),
                    OUT_OF_VOCAB_REMEDY,
                )
        yield batch
