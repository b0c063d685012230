"""``--init-ulp-nudge``: every floating-point parameter at its K-th next representable value, in
its own dtype, and nothing else touched; refused with ``--load``."""

from __future__ import annotations

import sys

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


def _fake_megatron_training(monkeypatch, built):
    """``megatron.training`` with a ``get_model`` that returns ``built`` (re-exported by the
    package, as Megatron-LM's does)."""
    import types

    package = types.ModuleType("megatron.training")
    training = types.ModuleType("megatron.training.training")

    def get_model(*args, **kwargs):
        return built

    training.get_model = package.get_model = get_model
    package.training = training
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    monkeypatch.setattr(weight_nudge, "nudged_models", 0)
    return package, training


def test_a_scripts_models_come_out_of_get_model_nudged(monkeypatch):
    """run_script's hook: what Megatron-LM's ``get_model`` builds (a list of chunks) leaves it
    nudged, through the module's and the package's name alike, and is counted."""
    model = _model(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    package, training = _fake_megatron_training(monkeypatch, [model])
    weight_nudge.nudge_megatron_lm_models(-1)
    assert package.get_model is training.get_model
    assert training.get_model(None) == [model] and weight_nudge.nudged_models == 1
    for old, new in zip(before, model.parameters(), strict=True):
        assert (new.detach().float() < old.float()).all()


def test_a_script_run_asked_to_nudge_says_when_it_cannot(monkeypatch, tmp_path, capsys):
    """A bad ``$MEGATRON_NPU_INIT_ULP_NUDGE``, and a script that builds no model through
    ``get_model``: each one line and exit 2, never a run that passes for a perturbed one."""
    from megatron_npu import run_script

    monkeypatch.setenv(weight_nudge.ENV, "one")
    with pytest.raises(ValueError, match=r"\$MEGATRON_NPU_INIT_ULP_NUDGE must be a whole number"):
        weight_nudge.ulps_from_environment()
    monkeypatch.setenv(weight_nudge.ENV, "1")
    _fake_megatron_training(monkeypatch, [])
    script = tmp_path / "no_model.py"
    script.write_text("print('trained without get_model')\n")
    with pytest.raises(SystemExit) as stop:
        run_script.run(str(script))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "built no model through Megatron-LM's get_model" in err[0], err
