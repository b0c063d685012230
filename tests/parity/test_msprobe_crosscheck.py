"""Our stage-1 metrics and verdicts against Ascend msprobe's own functions (mindstudio-probe).

A battery of tensors (fp16 / bf16 / fp32; ordinary, tiny, all-zero, single-element, with
inf/nan, with errors at every dual-N level) goes through :func:`megatron_npu.parity.metrics.compare`
and through msprobe 26.2.0's ``compare/algorithm.py`` functions and its stage-1 decision
(``Comparator._compare_torch_tensor``). Equal numbers and verdicts are asserted, and every
departure named in docs/parity-results.md is asserted explicitly, so a change on either side
shows up here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from megatron_npu.parity.benchmark import LEVEL_LIMITS, SMALL_VALUE_LIMIT, benchmark_result  # noqa: E402
from megatron_npu.parity.metrics import compare, dtype_config  # noqa: E402
from megatron_npu.parity.verdict import verdict  # noqa: E402
from msprobe.pytorch.api_accuracy_checker.compare import algorithm as ms
from msprobe.pytorch.api_accuracy_checker.compare.compare import Comparator
from msprobe.pytorch.api_accuracy_checker.compare.compare_column import (
    CompareColumn,
)
from msprobe.pytorch.api_accuracy_checker.precision_standard.standard_config import (
    StandardConfig,
)

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
INF, NAN = math.inf, math.nan


def _ref_dtype(dtype):
    return F64 if dtype is F32 else F32


def _pair(values, dtype, rel_noise=0.0, seed=0, scale=1.0):
    """(actual in dtype, reference upcast) with the reference exactly the rounded inputs'
    result and the actual off by ``rel_noise`` (relative, random sign)."""
    ref = torch.as_tensor(values, dtype=F64) * scale
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(ref.shape, generator=g, dtype=F64) * 2 - 1) * rel_noise
    return (ref * (1 + noise)).to(dtype), ref.to(_ref_dtype(dtype))


def _randn(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=F64)


def battery():
    cases = {}
    for dtype in (F16, BF16, F32):
        name = str(dtype).removeprefix("torch.")
        cases[f"{name}-rounded"] = _pair(_randn(512), dtype)
        cases[f"{name}-noisy-1e-4"] = _pair(_randn(512, 1), dtype, rel_noise=1e-4)
        cases[f"{name}-noisy-3e-3"] = _pair(_randn(512, 2), dtype, rel_noise=3e-3)
        cases[f"{name}-noisy-3e-2"] = _pair(_randn(512, 3), dtype, rel_noise=3e-2)
        cases[f"{name}-tiny"] = _pair(_randn(256, 4), dtype, rel_noise=1e-3, scale=1e-6)
        cases[f"{name}-all-zero"] = (
            torch.zeros(16, dtype=dtype),
            torch.zeros(16).to(_ref_dtype(dtype)),
        )
        cases[f"{name}-single"] = _pair([0.75], dtype, rel_noise=1e-2)
        cases[f"{name}-mixed-small"] = _pair(
            torch.cat([_randn(64, 5) * 1e-5, _randn(64, 6)]), dtype, rel_noise=2e-3
        )
    return cases


BATTERY = battery()


def _np(actual, reference):
    """What msprobe's Comparator hands its algorithm functions (bf16 -> fp32 both)."""
    if actual.dtype == BF16:
        actual, reference = actual.float(), reference.float()
    return actual.reshape(-1).numpy(), reference.reshape(-1).numpy()


def _msprobe_stage1(actual, reference):
    comparator = Comparator("unused-result.csv", "unused-details.csv", True)
    status, column, _ = comparator._compare_torch_tensor(
        "matmul", reference.clone(), actual.clone(), CompareColumn(), False
    )
    return status, column


@pytest.mark.parametrize("name", sorted(BATTERY))
def test_stage1_metrics_equal_msprobe(name):
    actual, reference = BATTERY[name]
    dtype = actual.dtype
    ours = compare(actual, reference, dtype)
    x, r = _np(actual, reference)
    abs_err = ms.get_abs_err(r, x)
    _, abs_bench_eps = ms.get_abs_bench_with_eps(r, dtype)
    rel = ms.get_rel_err_origin(abs_err, abs_bench_eps)

    assert np.array_equal(abs_bench_eps, np.abs(r) + np.asarray(ours.rel_eps, dtype=r.dtype))
    assert ours.max_abs_error == float(ms.get_max_abs_err(abs_err)[0])
    for level, field in (
        (0.01, "dual_hundredth"),
        (0.001, "dual_thousandth"),
        (0.0001, "dual_ten_thousandth"),
    ):
        assert getattr(ours, field) == float(ms.get_rel_err_ratio(rel, level)[0]), field
    cos, _, _ = ms.cosine_sim(r, x)
    if x.size == 1 or (np.max(np.abs(x)) <= np.finfo(float).eps):
        assert isinstance(cos, str)  # msprobe leaves the cell blank
        assert ours.cosine in (None, 1.0)
    else:
        assert ours.cosine == float(cos)

    # msprobe's benchmark-standard numbers (per side)
    small_value = StandardConfig.get_small_value(dtype, "benchmark")
    assert ours.small_value_threshold == small_value
    finite, inf_nan = ms.get_finite_and_infinite_mask(r, x)
    small = ms.get_small_value_mask(np.abs(r), finite, small_value)
    rel_b = ms.get_rel_err(abs_err, abs_bench_eps, small, inf_nan)
    assert ours.max_rel_error == float(ms.get_max_rel_err(rel_b))
    assert ours.mean_rel_error == float(ms.get_mean_rel_err(rel_b))
    assert ours.error_balance == float(ms.get_error_balance(r, x))
    ulp = ms.get_ulp_err(r, x, dtype)
    assert ours.ulp_max == float(np.max(ulp)) and ours.ulp_mean == float(np.mean(ulp))

    atol_ms = StandardConfig.get_small_value_atol(dtype, "benchmark")
    ms_share = float(ms.get_small_value_err_ratio(small, np.greater(abs_err, atol_ms)))
    if dtype is F32:
        assert (ours.small_value_atol, ours.small_value_error_share) == (atol_ms, ms_share)
    else:  # departure 1: fp16/bf16 small-value atol T*eps instead of msprobe's 1e-16
        assert ours.small_value_atol == small_value * torch.finfo(dtype).eps > atol_ms
        share = ms.get_small_value_err_ratio(small, np.greater(abs_err, ours.small_value_atol))
        assert ours.small_value_error_share == float(share) <= ms_share

    # departure 2: RMSE over the unmasked count exactly; msprobe scales the mean square
    masked = np.logical_or(inf_nan, small)
    n, k = abs_err.size, int(masked.sum())
    expected = math.sqrt(ours.rmse**2 * (n - k) / n * (n / (n - k + 0.0001) + 0.0001))
    assert float(ms.get_rmse(abs_err, masked)) == pytest.approx(expected, rel=1e-5, abs=1e-30)


@pytest.mark.parametrize("name", sorted(BATTERY))
def test_stage1_verdict_equals_msprobe_or_is_the_relative_l2_departure(name):
    actual, reference = BATTERY[name]
    comparison = compare(actual, reference, actual.dtype)
    theirs, _ = _msprobe_stage1(actual, reference)
    # departure 3 (an added rule): without the relative L2 rule the verdicts are msprobe's
    without_l2 = verdict(dataclasses.replace(comparison, rel_l2=None))
    assert without_l2.status == theirs, (without_l2, theirs)
    ours = verdict(comparison)
    if ours.rule == "rel_l2":
        assert ours.status == "error"  # possibly where msprobe passes or warns


def test_the_battery_reaches_every_stage1_outcome():
    outcomes = {verdict(compare(a, r, a.dtype)).rule for a, r in BATTERY.values()}
    statuses = {_msprobe_stage1(a, r)[0] for a, r in BATTERY.values()}
    assert {"max_abs", "dual_hundredth", "rel_l2"} <= outcomes
    assert statuses == {"pass", "warning", "error"}
    missed = [
        n
        for n, (a, r) in BATTERY.items()
        if verdict(compare(a, r, a.dtype)).rule == "rel_l2" and _msprobe_stage1(a, r)[0] != "error"
    ]
    assert missed, "the battery should show an error the msprobe shortcut lets through"


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_non_finite_positions_departure(dtype):
    """Departure 4: matching inf/nan are a match and left out; any other non-finite position
    is an error at once. msprobe keeps them in its arrays as failing NaN errors."""
    rd = _ref_dtype(dtype)
    actual = torch.tensor([NAN, INF, 1.0, 2.0, -INF, 3.0, 4.0, 5.0], dtype=dtype)
    reference = torch.tensor([NAN, INF, 1.0, 2.0, -INF, 3.0, 4.0, 5.0], dtype=rd)
    ours = compare(actual, reference, dtype)
    assert (ours.nonfinite_match_count, ours.compared_count) == (3, 5)
    assert verdict(ours).status == "pass"
    x, r = _np(actual, reference)
    rel = ms.get_rel_err_origin(ms.get_abs_err(r, x), ms.get_abs_bench_with_eps(r, dtype)[1])
    assert float(ms.get_rel_err_ratio(rel, 0.01)[0]) == 5 / 8  # the 3 matches count as failing
    assert math.isnan(ms.get_max_abs_err(ms.get_abs_err(r, x))[0])
    assert _msprobe_stage1(actual, reference)[0] == "error"
    # our numbers equal msprobe's on the compared (finite) positions
    finite = torch.isfinite(actual.to(F64)) & torch.isfinite(reference.to(F64))
    sub = compare(actual[finite], reference[finite], dtype)
    assert (
        dataclasses.replace(
            ours, nonfinite_match_count=0, numel=5, actual_shape=(5,), reference_shape=(5,)
        )
        == sub
    )

    mismatch = compare(
        torch.tensor([1.0, NAN] + [2.0] * 198, dtype=dtype),
        torch.tensor([1.0, 2.0] + [2.0] * 198, dtype=rd),
        dtype,
    )
    assert (verdict(mismatch).status, verdict(mismatch).rule) == ("error", "inf_nan")


def test_empty_tensor_departure():
    """Departure 5: msprobe skips an empty output; here it passes with rule 'empty'."""
    a, r = torch.empty(0, dtype=F16), torch.empty(0, dtype=F32)
    assert _msprobe_stage1(a, r)[0] == "SKIP"
    v = verdict(compare(a, r, F16))
    assert (v.status, v.rule) == ("pass", "empty")


def test_rule_dtype_departure():
    """Departure 6: the rules use the cell's dtype, not the tensor's storage dtype (an fp32
    rstd of a bf16 op is judged as bf16: eps 2**-8), msprobe uses the tensor's dtype."""
    a = torch.tensor([1.0, 2.0, 3.0], dtype=F32)
    r = torch.tensor([1.0, 2.0, 3.0], dtype=F32)
    assert compare(a, r, BF16).rel_eps == 2**-8
    assert ms.get_abs_bench_with_eps(r.numpy(), F32)[1][0] - 1.0 == np.finfo(np.float32).eps


def test_integer_outputs_are_compared_exactly_like_msprobe():
    a, r = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])
    assert ms.compare_bool_tensor(r.numpy(), a.numpy())[1] == "error"
    assert verdict(compare(a, r, F32)).status == "error"
    assert ms.compare_bool_tensor(r.numpy(), r.numpy())[1] == "pass"
    assert verdict(compare(r, r, F32)).status == "pass"


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_benchmark_ratios_use_msprobe_floor_and_limits(dtype):
    ref = _randn(512, 7).to(F32)
    tested = compare((ref * (1 + 0.01)).to(dtype), ref, dtype)
    bench = compare(ref.to(dtype), ref, dtype)
    res = benchmark_result(tested, bench, "L2")
    for key in ("rmse", "max_rel_error", "mean_rel_error", "small_value_error_share"):
        assert res.ratios[key] == ms.calc_ratio(
            getattr(tested, key), getattr(bench, key), str(dtype)
        )
    msprobe_names = {
        "rmse": "rmse",
        "max_rel_error": "max_rel_err",
        "mean_rel_error": "mean_rel_err",
    }
    for level in LEVEL_LIMITS:
        for ours, theirs in msprobe_names.items():
            assert LEVEL_LIMITS[level][ours] == StandardConfig.get_benchmark_ratio_threshold(
                theirs, level=level
            )
    assert SMALL_VALUE_LIMIT == StandardConfig.get_benchmark_ratio_threshold("small_value")
    assert dtype_config(dtype).benchmark_min_err == StandardConfig.get_minmum_err(str(dtype))
    assert res.status == "error"  # a 1 % error everywhere is far beyond bf16/fp16 rounding
