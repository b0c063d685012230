"""``--init-ulp-nudge``: every floating-point parameter at its K-th next representable value, in
its own dtype, and nothing else touched; refused with ``--load``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_npu.training import weight_nudge
from megatron_npu.training.arguments import parse_args


def _model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)).to(dtype)
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ulps", [1, -2])
def test_each_weight_moves_exactly_k_ulps_of_its_dtype(dtype, ulps):
    model = _model(dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert weight_nudge.nudge([model], ulps) == 4
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16}.get(dtype)
    for name, param in model.named_parameters():
        old, new = before[name].float(), param.detach().float()
        assert ((new > old) if ulps > 0 else (new < old)).all(), name
        if np_dtype is not None:  # numpy's own nextafter, stepped K times
            want = before[name].numpy()
            for _ in range(abs(ulps)):
                want = np.nextafter(want, np.inf if ulps > 0 else -np.inf).astype(np_dtype)
            np.testing.assert_array_equal(param.detach().numpy(), want)
        else:  # bf16: no value strictly between the old and the new one
            mid = ((old + new) / 2).to(dtype).float()
            assert ((mid == old) | (mid == new)).all() or abs(ulps) > 1
    assert model.steps.tolist() == [0, 0, 0]
    assert weight_nudge.nudge([model], 0) == 0


def test_the_nudge_is_refused_on_a_resumed_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(
            [
                "--num-layers",
                "1",
                "--hidden-size",
                "8",
                "--num-attention-heads",
                "2",
                "--seq-length",
                "8",
                "--micro-batch-size",
                "1",
                "--train-iters",
                "1",
                "--lr",
                "1e-3",
                "--mock-data",
                "--init-ulp-nudge",
                "1",
                "--load",
                str(tmp_path),
            ]
        )
    assert stop.value.code == 2
    assert "--init-ulp-nudge moves initial weights" in capsys.readouterr().err
