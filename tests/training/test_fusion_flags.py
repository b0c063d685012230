"""Megatron's fusion flags reach the fused-op patches in training.

``--bias-swiglu-fusion``, ``--bias-gelu-fusion``, ``--masked-softmax-fusion``,
``--gradient-accumulation-fusion`` and ``--bias-dropout-fusion`` (Megatron-LM's names and
defaults: on) set the TransformerConfig's fusion fields, so on ``npu-emulated`` a training step
calls ``npu_swiglu`` (or ``npu_gelu``) and ``npu_scaled_masked_softmax``: counted with
``count_kernel_calls`` around one-rank training in a child process. With the ``--no-...`` forms
none of them is called.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_npu.training import arguments
from megatron_npu.training.model import transformer_config

from ._runner import REPO, TIMEOUT_S, TINY

_BASE = [
    "--seq-length",
    "32",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "2",
]

# one rank trains in-process under the counter and prints what was called
_CHILD = """
import json, sys
from megatron_npu.testing.torch_npu_emulation import count_kernel_calls
from megatron_npu.training import loop
with count_kernel_calls() as calls:
    loop.run(sys.argv[1:])
print("KERNELS=" + json.dumps(dict(calls)))
"""


def _parse(*extra):
    return arguments.parse_args(
        ["--mock-data", *_BASE, "--train-iters", "1", "--lr", "1e-3", *extra]
    )


def test_flags_have_megatron_names_and_defaults():
    args = _parse()
    assert (args.bias_swiglu_fusion, args.bias_gelu_fusion, args.masked_softmax_fusion) == (
        True,
        True,
        True,
    )
    assert args.gradient_accumulation_fusion and args.bias_dropout_fusion
    args = _parse("--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion")
    assert not (args.gradient_accumulation_fusion or args.bias_dropout_fusion)
    args = _parse("--no-bias-swiglu-fusion", "--no-bias-gelu-fusion", "--no-masked-softmax-fusion")
    assert not (args.bias_swiglu_fusion or args.bias_gelu_fusion or args.masked_softmax_fusion)
    # Megatron-LM: no bias, no bias-GeLU fusion
    assert _parse("--disable-bias-linear").bias_gelu_fusion is False


@pytest.mark.parametrize(
    ("extra", "activation", "softmax"),
    [
        (("--swiglu",), True, True),
        (("--swiglu", "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion"), False, False),
        ((), True, True),  # GeLU: --bias-gelu-fusion
        (("--no-bias-gelu-fusion",), False, True),
    ],
)
def test_transformer_config_carries_the_flags(extra, activation, softmax):
    config = transformer_config(_parse(*extra))
    assert config.bias_activation_fusion is activation
    assert config.masked_softmax_fusion is softmax


def test_gradient_accumulation_fusion_follows_its_kernel(monkeypatch, capsys):
    """On where a kernel serves it (the adaptor's off CUDA, apex's on cuda), as Megatron-LM; a
    GPU without apex gets it off and one line saying so, not megatron-core's refusal."""
    from megatron.core.tensor_parallel import layers

    from megatron_npu.training import model

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    config = transformer_config(_parse())
    assert config.gradient_accumulation_fusion and config.bias_dropout_fusion
    off = transformer_config(
        _parse("--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion")
    )
    assert not (off.gradient_accumulation_fusion or off.bias_dropout_fusion)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    model._say_no_gradient_accumulation_fusion.cache_clear()
    assert transformer_config(_parse()).gradient_accumulation_fusion is False
    assert "--gradient-accumulation-fusion is off" in capsys.readouterr().err


def _kernels(*extra):
    argv = [a if a != "cpu" else "npu-emulated" for a in TINY] + [
        *_BASE,
        "--fp16",
        "--train-iters",
        "1",
        *extra,
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("KERNELS="))
    return json.loads(line.removeprefix("KERNELS="))


@pytest.mark.slow
def test_fp16_training_step_calls_the_fused_kernels():
    on = _kernels("--swiglu")
    assert on.get("npu_swiglu", 0) > 0 and on.get("npu_scaled_masked_softmax", 0) > 0, on
    gelu = _kernels()
    assert gelu.get("npu_gelu", 0) > 0 and "npu_swiglu" not in gelu, gelu
    off = _kernels("--swiglu", "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion")
    assert "npu_swiglu" not in off and "npu_scaled_masked_softmax" not in off, off
