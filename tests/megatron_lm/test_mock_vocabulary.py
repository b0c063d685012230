"""``--mock-data --vocab-size N`` means what it means in Megatron-LM: the NullTokenizer that
Megatron-LM's own training layer (the tag matching the installed megatron-core, from the shared
folder) builds for ``--tokenizer-type NullTokenizer --vocab-size N`` has the size and EOD id of
``megatron_npu.data.tokenizers.null_tokenizer(N)``, which ``megatron-npu train`` reads its mock
data with and fingerprints its checkpoints by; and ``null_vocab_size_for`` inverts it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_npu.data.tokenizers import null_tokenizer, null_vocab_size_for
from megatron_npu.training import arguments, preflight

from ._client import megatron_lm_folder

#: Megatron-LM's argument parser (every default), then the tokenizer its start-up builds
BUILD = r"""
import json, sys
from megatron.training import arguments, global_vars
sizes = [int(n) for n in sys.argv[1:]]
found = {}
for size in sizes:
    sys.argv = ["pretrain_gpt.py", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(size)]
    args = arguments.parse_args()
    args.rank = 0
    global_vars._GLOBAL_TOKENIZER = None
    tokenizer = global_vars._build_tokenizer(args)
    found[size] = [int(tokenizer.vocab_size), int(tokenizer.eod)]
print("SIZES " + json.dumps(found))
"""

SIZES = (128, 256, 1023, 1279)


@pytest.fixture(scope="module")
def megatron_lm_null_tokenizers() -> dict[int, list[int]]:
    folder = megatron_lm_folder()
    proc = subprocess.run(
        [sys.executable, "-c", BUILD, *map(str, SIZES)],
        cwd=folder,
        env={"PYTHONPATH": str(folder), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("SIZES ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {int(k): v for k, v in json.loads(line.removeprefix("SIZES ")).items()}


@pytest.mark.parametrize("size", SIZES)
def test_vocab_size_builds_megatron_lms_null_tokenizer(megatron_lm_null_tokenizers, size):
    ours = null_tokenizer(size)
    assert [int(ours.vocab_size), int(ours.eod)] == megatron_lm_null_tokenizers[size]
    args = arguments.parse_args(
        [
            "--device",
            "cpu",
            "--mock-data",
            "--vocab-size",
            str(size),
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "64",
            "--micro-batch-size",
            "2",
            "--train-iters",
            "1",
            "--lr",
            "1e-3",
        ]
    )
    assert preflight.tokenizer_vocab_size(args) == megatron_lm_null_tokenizers[size][0]


@pytest.mark.parametrize("tokens", (256, 1024))
def test_vocab_size_for_a_tokenizer_size(tokens):
    assert null_tokenizer(null_vocab_size_for(tokens)).vocab_size == tokens
