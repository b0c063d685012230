"""Every fingerprint field read off a real Megatron-LM log as Megatron-LM names it: the H100's
native ``pretrain_gpt.py`` run of ``../shared/gpu-logs/h100-tiny`` (its ``ARGS.txt`` holds the
options), field by field against what those options mean. The Llama-style fields (no linear
bias, untied embeddings, GQA, SwiGLU, RMSNorm, RoPE) are held on a Megatron-LM log of the
adaptor's own making in ``tests/locate/test_locate_script.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_npu.compare import fingerprint as fp
from megatron_npu.compare import imports
from megatron_npu.formats.metrics import RunConfig

GPU_LOGS = Path(__file__).resolve().parents[3] / "shared" / "gpu-logs"
H100_TINY = GPU_LOGS / "h100-tiny" / "gpt-fp32.log"

#: what ARGS.txt's options mean, field by field (Megatron-LM's derivations: ffn 4h, kv h/heads,
#: one query group per head without --group-query-attention, the NullTokenizer's N + 1 tokens
#: padded to a multiple of 128)
EXPECTED = {
    "num_layers": 4,
    "hidden_size": 256,
    "ffn_hidden_size": 1024,
    "num_attention_heads": 8,
    "num_query_groups": 8,
    "kv_channels": 32,
    "seq_length": 256,
    "max_position_embeddings": 256,
    "position_embedding_type": "learned_absolute",
    "normalization": "LayerNorm",
    "swiglu": False,
    "bias_linear": True,
    "tied_embeddings": True,
    "init_method_std": 0.02,
    "attention_window": "causal, pre full, next full",
    "attention": "standard",
    "experts": "dense",
    "padded_vocab_size": 1024,
    "seed": 1234,
    "init": "megatron, host",  # --use-cpu-initialization
    "tokenizer": "NullTokenizer",
}


@pytest.fixture(scope="module")
def h100_fingerprint() -> dict:
    if not H100_TINY.is_file():
        raise AssertionError(f"{H100_TINY}: the shared GPU logs are missing")
    return fp.fingerprint(imports.load(H100_TINY).metrics.config)


@pytest.mark.parametrize("field", sorted(EXPECTED))
def test_each_field_of_a_gpu_log_means_what_its_options_say(h100_fingerprint, field):
    assert h100_fingerprint[field] == EXPECTED[field]


def test_the_fields_cover_the_fingerprint(h100_fingerprint):
    assert set(EXPECTED) | {"data"} == set(fp.FIELDS) == set(h100_fingerprint)
    assert h100_fingerprint["data"].startswith("mock: vocab 1024")


def test_bias_is_read_under_either_trainers_name():
    """Megatron-LM dumps ``add_bias_linear`` (False with --disable-bias-linear); megatron-npu
    train keeps ``disable_bias_linear``."""
    for args, bias in (
        ({"add_bias_linear": False}, False),
        ({"add_bias_linear": True}, True),
        ({"disable_bias_linear": True}, False),
        ({}, True),
    ):
        assert fp.fingerprint(RunConfig(arguments=args))["bias_linear"] is bias


def test_the_init_field_tells_apart_runs_that_start_from_other_weights():
    """Megatron's device initialisation draws from the device's own generator: a CUDA run and a
    run drawn on the host's generator (cpu, npu-emulated) start from other weights; the host
    initialisation and the layout-independent stream are the same on every device."""

    def init(device, **args):
        return fp.fingerprint(RunConfig(device=device, arguments=args))["init"]

    assert init("cuda") == "megatron, device (cuda generator)"
    assert init("npu-emulated") == init("cpu") == "megatron, device (cpu generator)"
    assert init("npu") == "megatron, device (npu generator)"
    assert init("cuda", use_cpu_initialization=True) == init(
        "npu-emulated", use_cpu_initialization=True
    )
    assert init("cuda", layout_independent_init=True, use_cpu_initialization=True) == init(
        "npu", layout_independent_init=True
    )
    assert init("cuda", use_cpu_initialization=True) != init("cuda", layout_independent_init=True)
    names = [
        n
        for n, *_ in fp.differences(
            fp.fingerprint(RunConfig(device="cuda", arguments={"use_cpu_initialization": True})),
            fp.fingerprint(
                RunConfig(device="npu-emulated", arguments={"layout_independent_init": True})
            ),
        )
    ]
    assert names == ["init"]
