"""Metrics and verdicts against hand-computed numbers (msprobe's rules as docs/parity-results.md
states them; test_msprobe_crosscheck.py checks the numbers against msprobe itself)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from megatron_npu.parity.metrics import TensorComparison, compare
from megatron_npu.parity.verdict import Tolerance, Verdict, verdict, worst

from megatron_npu.formats.parity_record import TensorMetrics

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def t(values, dtype):
    return torch.tensor(values, dtype=dtype)


# --------------------------------------------------------------------------- metrics


def test_fp32_four_elements_every_metric():
    # errors: 0, +2**-20 (above), -2**-10 (below), 0
    ref = [1.0, 2.0, 4.0, 0.5]
    act = [1.0, 2.0 + 2**-20, 4.0 - 2**-10, 0.5]
    c = compare(t(act, F32), t(ref, F64), F32)

    eps = 2**-52  # msprobe: finfo of the (fp64) reference's dtype
    assert c.kind == "float"
    assert c.rel_eps == eps
    assert (c.dtype, c.actual_dtype, c.reference_dtype) == ("float32", "float32", "float64")
    assert c.actual_shape == c.reference_shape == (4,)
    assert (c.numel, c.compared_count) == (4, 4)
    assert (c.inf_nan_mismatch_count, c.nonfinite_match_count) == (0, 0)
    assert c.exact_mismatch_count is None

    assert c.max_abs_error == 2**-10
    rel = [0.0, 2**-20 / (2.0 + eps), 2**-10 / (4.0 + eps), 0.0]
    assert c.max_rel_error == pytest.approx(rel[2], rel=1e-12)
    assert c.mean_rel_error == pytest.approx(sum(rel) / 4, rel=1e-12)
    # rel errors ~0, 4.8e-7, 2.4e-4, 0: all below 1e-2 and 1e-3, three below 1e-4
    assert (c.dual_hundredth, c.dual_thousandth, c.dual_ten_thousandth) == (1.0, 1.0, 0.75)
    assert c.rmse == pytest.approx(math.sqrt((2**-40 + 2**-20) / 4), rel=1e-12)
    assert c.error_balance == 0.0  # one above, one below
    dot = 1 * 1 + (2 + 2**-20) * 2 + (4 - 2**-10) * 4 + 0.25
    nx = math.sqrt(1 + (2 + 2**-20) ** 2 + (4 - 2**-10) ** 2 + 0.25)
    nr = math.sqrt(1 + 4 + 16 + 0.25)
    assert c.cosine == pytest.approx(dot / (nx * nr), abs=1e-15)
    assert c.small_value_threshold == 2**-20
    assert (c.small_value_count, c.small_value_error_share) == (0, 0.0)
    # ULP of fp32 at 2 is 2**-22 -> 4 ULP; at 4 it is 2**-21 -> 2**11 ULP
    assert c.ulp_max == 2048.0
    assert c.ulp_mean == (0 + 4 + 2048 + 0) / 4
    assert c.ulp_bad_bound == 32.0
    assert c.ulp_bad_share == 0.25
    # relative L2 error: sqrt(2**-40 + 2**-20) / sqrt(21.25) = 2.1e-4, far above fp32's 64 u
    assert c.rel_l2 == pytest.approx(math.sqrt(2**-40 + 2**-20) / math.sqrt(21.25), rel=1e-12)
    assert c.rel_l2_bound == 64 * 2**-24
    assert (verdict(c).status, verdict(c).rule) == ("error", "rel_l2")


def test_fp16_small_values_rel_eps_and_ulp():
    t_small = 2**-10
    ref = [0.0, 2**-11, 2**-10, 0.5]
    act = [2**-9, 2**-11, 0.0, 0.5]
    c = compare(t(act, F16), t(ref, F32), F16)

    assert c.rel_eps == 2**-23  # msprobe: finfo(float32).eps of the reference
    assert c.small_value_threshold == t_small
    # small: |ref| <= 2**-10 -> first three; abs errors 2**-9, 0, 2**-10 vs atol T*eps = 2**-20
    assert c.small_value_atol == 2**-20
    assert c.small_value_count == 3
    assert c.small_value_error_share == pytest.approx(2 / 3)
    # max / mean relative error leave small values out (msprobe's benchmark standard)
    assert (c.max_rel_error, c.mean_rel_error) == (0.0, 0.0)
    # dual shares count every element: rel errors 2**14, 0, ~1, 0 -> half below any level
    assert (c.dual_hundredth, c.dual_thousandth) == (0.5, 0.5)
    # ULP (msprobe): ref 0 uses exponent 0 -> 2**-9 * 2**10 = 2; ref 2**-10 -> 2**-10 * 2**20
    assert c.ulp_max == 1024.0
    assert c.ulp_mean == (2 + 0 + 1024 + 0) / 4
    assert c.ulp_bad_share == 0.5
    assert c.ulp_bad_bound == 1.0
    # x > ref at 0, x < ref at 2
    assert c.error_balance == 0.0
    # the reference is mostly small: rel_l2 divides by max(|r|, sqrt(4) * T)
    assert c.rel_l2 == pytest.approx(
        math.sqrt(2**-18 + 2**-20) / math.sqrt(2**-22 + 2**-20 + 0.25), rel=1e-12
    )


def test_bf16_eps_is_2_pow_minus_8():
    c = compare(t([0.5 + 2**-8, 1.0], BF16), t([0.5, 1.0], F32), BF16)
    assert c.rel_eps == 2**-8
    assert c.max_rel_error == pytest.approx(2**-8 / (0.5 + 2**-8), rel=1e-6)
    assert c.small_value_threshold == 2**-10


def test_bf16_ulp_bound_is_one():
    # bf16 ULP at 1.0 is 2**-7: 1 + 2**-7 is 1 ULP (fine), 2 + 2**-5 at 2 is 2 ULP (bad)
    c = compare(t([1.0 + 2**-7, 2.0 + 2**-5], BF16), t([1.0, 2.0], F32), BF16)
    assert c.ulp_max == 2.0
    assert c.ulp_bad_share == 0.5


def test_error_balance_compares_with_reference_rounded_to_actual_dtype():
    # 1.0001 rounds to 1.0 in fp16, so element 0 is neither above nor below
    ref = [1.0001, 2.0, 3.0, 4.0]
    act = [1.0, 2.0 + 2**-9, 3.0 + 2**-9, 4.0 - 2**-9]
    c = compare(t(act, F16), t(ref, F32), F16)
    assert c.error_balance == 0.25  # |2 above - 1 below| / 4
    # 0.9999 rounds to 1.0 in fp16: an exact 1.0 is not "above"
    c = compare(t([1.0, 2.0 + 2**-9], F16), t([0.9999, 2.0], F32), F16)
    assert c.error_balance == 0.5  # |1 above - 0 below| / 2


@pytest.mark.parametrize(
    ("act", "ref", "expected"),
    [
        ([0.0, 0.0], [0.0, 0.0], 1.0),  # both zero
        ([1.0, 0.0], [0.0, 0.0], 0.0),  # reference zero
        ([0.0, 0.0], [1.0, 1.0], 0.0),  # actual zero
        ([1.0, 0.0], [1.0, 1.0], 1 / math.sqrt(2)),
        ([-1.0, -2.0], [1.0, 2.0], -1.0),
    ],
)
def test_cosine(act, ref, expected):
    c = compare(t(act, F32), t(ref, F64), F32)
    assert c.cosine == pytest.approx(expected, abs=1e-12)


def test_matching_inf_nan_are_excluded_and_mismatch_counted():
    inf, nan = math.inf, math.nan
    c = compare(t([nan, inf, 1.0, -inf, 2.0], F32), t([nan, inf, 1.0, inf, 2.5], F64), F32)
    assert c.nonfinite_match_count == 2
    assert c.inf_nan_mismatch_count == 1  # -inf vs inf
    assert c.compared_count == 2
    assert c.max_abs_error == 0.5  # only 1.0 and 2.0 enter
    assert verdict(c).status == "error"
    assert verdict(c).rule == "inf_nan"


def test_matching_inf_only_keeps_numeric_metrics_clean():
    c = compare(t([math.inf, 1.0, 2.0], F32), t([math.inf, 1.0, 2.0], F64), F32)
    assert (c.nonfinite_match_count, c.inf_nan_mismatch_count) == (1, 0)
    assert (c.max_abs_error, c.rmse) == (0.0, 0.0)
    assert c.cosine == pytest.approx(1.0, abs=1e-12)
    assert verdict(c).status == "pass"


def test_nan_in_actual_only_is_a_mismatch():
    c = compare(t([1.0, math.nan], BF16), t([1.0, 2.0], F32), BF16)
    assert c.inf_nan_mismatch_count == 1
    assert verdict(c).status == "error"


def test_reference_overflowing_the_actual_dtype_counts_as_inf():
    # 70000 is above fp16's max (65504): fp16 inf matches it, a finite 65504 does not
    ok = compare(t([math.inf, 1.0], F16), t([70000.0, 1.0], F32), F16)
    assert (ok.nonfinite_match_count, ok.inf_nan_mismatch_count) == (1, 0)
    bad = compare(t([65504.0, 1.0], F16), t([70000.0, 1.0], F32), F16)
    assert bad.inf_nan_mismatch_count == 1


def test_empty_tensor():
    c = compare(torch.empty(0, 3, dtype=F32), torch.empty(0, 3, dtype=F64), F32)
    assert (c.numel, c.compared_count, c.actual_shape) == (0, 0, (0, 3))
    assert c.cosine == 1.0
    assert (c.dual_hundredth, c.dual_thousandth, c.dual_ten_thousandth) == (1.0, 1.0, 1.0)
    assert (c.max_abs_error, c.rmse, c.error_balance, c.ulp_max) == (0.0, 0.0, 0.0, 0.0)
    v = verdict(c)
    assert (v.status, v.rule) == ("pass", "empty")


def test_integer_and_bool_tensors_are_exact():
    c = compare(t([1, 2, 3], torch.int64), t([1, 2, 4], torch.int64), F32)
    assert c.kind == "exact"
    assert c.exact_mismatch_count == 1
    assert c.cosine is None and c.max_abs_error is None
    assert verdict(c).status == "error"
    assert "1 of 3 elements differ" in verdict(c).reason

    b = compare(t([True, False], torch.bool), t([True, False], torch.bool), BF16)
    assert (b.kind, b.exact_mismatch_count) == ("exact", 0)
    assert verdict(b).status == "pass"


def test_integer_against_float_is_rejected():
    with pytest.raises(ValueError, match="integer/bool"):
        compare(t([1, 2], torch.int32), t([1.0, 2.0], F32), F16)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
        compare(torch.zeros(2, 3, dtype=F32), torch.zeros(3, 2, dtype=F64), F32)


def test_reference_must_be_upcast():
    with pytest.raises(ValueError, match="float64 reference"):
        compare(torch.zeros(2, dtype=F32), torch.zeros(2, dtype=F32), F32)
    with pytest.raises(ValueError, match="float32 or float64 reference"):
        compare(torch.zeros(2, dtype=F16), torch.zeros(2, dtype=F16), F16)


def test_unsupported_dtype():
    with pytest.raises(ValueError, match="unsupported parity dtype"):
        compare(torch.zeros(2, dtype=F64), torch.zeros(2, dtype=F64), F64)


def test_comparison_is_frozen_and_round_trips():
    c = compare(t([1.0, 2.0], F16), t([1.0, 2.001], F32), F16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.cosine = 0.0  # type: ignore[misc]
    # the record format's metrics hold exactly the comparison's fields
    back = TensorMetrics.model_validate(c.to_dict()).model_dump()
    shapes = {k: tuple(back[k]) for k in ("actual_shape", "reference_shape")}
    assert TensorComparison(**{**back, **shapes}) == c


# --------------------------------------------------------------------------- verdicts


def base(dtype: str = "float16", **changes) -> TensorComparison:
    """A perfect comparison with chosen metrics overridden."""
    torch_dtype = getattr(torch, dtype)
    ref_dtype = F64 if torch_dtype is F32 else F32
    c = compare(t([1.0, 2.0], torch_dtype), t([1.0, 2.0], ref_dtype), torch_dtype)
    return dataclasses.replace(c, **changes)


BAD_ABS = 0.5  # above the 1e-3 instant pass


def test_inf_nan_mismatch_is_error_first():
    v = verdict(base(inf_nan_mismatch_count=2))
    assert (v.status, v.rule) == ("error", "inf_nan")
    assert "2 inf/nan" in v.reason


@pytest.mark.parametrize("cosine", [0.97, 0.99])
def test_cosine_not_above_0_99_is_error(cosine):
    v = verdict(base(cosine=cosine))  # max abs 0 would pass, but cosine comes first
    assert (v.status, v.rule) == ("error", "cosine")
    assert v.reason == f"cosine {cosine:g} <= 0.99"


def test_max_abs_below_1e_3_passes_at_once():
    v = verdict(base(max_abs_error=9.99e-4, dual_hundredth=0.0, dual_thousandth=0.0))
    assert (v.status, v.rule) == ("pass", "max_abs")
    # exactly 1e-3 does not pass at once: falls through to the dual checks
    v = verdict(base(max_abs_error=1e-3, dual_hundredth=0.0, dual_thousandth=0.0))
    assert (v.status, v.rule) == ("error", "dual_hundredth")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    ("hundredth", "thousandth", "status", "rule"),
    [
        (0.98, 0.5, "error", "dual_hundredth"),
        (0.99, 0.99, "error", "dual_hundredth"),  # must exceed 1 - 0.01
        (0.995, 0.998, "warning", "dual_thousandth"),
        (0.995, 0.999, "warning", "dual_thousandth"),  # must exceed 1 - 0.001
        (1.0, 0.9995, "pass", "dual_thousandth"),
    ],
)
def test_half_dual_rules(dtype, hundredth, thousandth, status, rule):
    c = base(
        dtype,
        max_abs_error=BAD_ABS,
        dual_hundredth=hundredth,
        dual_thousandth=thousandth,
        dual_ten_thousandth=0.0,  # not used for half types
    )
    v = verdict(c)
    assert (v.status, v.rule, v.override) == (status, rule, False)


@pytest.mark.parametrize(
    ("thousandth", "ten_thousandth", "status", "rule"),
    [
        (0.998, 0.5, "error", "dual_thousandth"),
        (0.9995, 0.9995, "warning", "dual_ten_thousandth"),
        (0.9995, 0.9999, "warning", "dual_ten_thousandth"),
        (1.0, 0.99995, "pass", "dual_ten_thousandth"),
    ],
)
def test_fp32_dual_rules(thousandth, ten_thousandth, status, rule):
    c = base(
        "float32",
        max_abs_error=BAD_ABS,
        dual_hundredth=1.0,
        dual_thousandth=thousandth,
        dual_ten_thousandth=ten_thousandth,
    )
    v = verdict(c)
    assert (v.status, v.rule) == (status, rule)


def test_reason_names_the_rule_and_numbers():
    v = verdict(base("float16", max_abs_error=BAD_ABS, dual_hundredth=0.9, dual_thousandth=0.5))
    assert v.reason == "dual hundredth 0.9 <= 0.99 (share of relative error < 0.01)"


def test_real_comparison_errors_on_bf16_hundredth():
    # 1/4 of elements off by ~2.4% -> dual hundredth 0.75, max abs 0.1
    c = compare(t([1.0, 2.0, 3.0, 4.0], BF16), t([1.0, 2.0, 3.0, 4.1], F32), BF16)
    assert c.dual_hundredth == 0.75
    assert verdict(c).status == "error"


def test_override_cosine_and_reason_is_reported():
    tol = Tolerance(cosine=0.95, reason="softmax of saturated logits")
    c = base(cosine=0.97)
    assert verdict(c).status == "error"
    v = verdict(c, tol)
    assert (v.status, v.rule, v.override) == ("pass", "max_abs", True)
    assert "softmax of saturated logits" in v.reason
    # an override that fails still says it was in effect, and which threshold was changed
    v = verdict(base(cosine=0.94), tol)
    assert (v.status, v.override) == ("error", True)
    assert "cosine 0.94 <= 0.95 (overridden threshold)" in v.reason


def test_override_abs_pass():
    tol = Tolerance(abs_pass=5e-3, reason="fp16 accumulation in the fused kernel")
    c = base(max_abs_error=2e-3, dual_hundredth=0.5, dual_thousandth=0.5)
    assert verdict(c).status == "error"
    v = verdict(c, tol)
    assert (v.status, v.rule) == ("pass", "max_abs")
    assert "overridden" in v.reason and "fp16 accumulation" in v.reason


def test_override_dual_levels():
    c = base("bfloat16", max_abs_error=BAD_ABS, dual_hundredth=0.995, dual_thousandth=0.99)
    assert verdict(c).status == "warning"
    strict = verdict(c, Tolerance(dual_error=1e-3, reason="must match the GPU closely"))
    assert (strict.status, strict.rule) == ("error", "dual_thousandth")
    loose = verdict(c, Tolerance(dual_warning=1e-2, reason="known bf16 rounding"))
    assert (loose.status, loose.rule) == ("pass", "dual_hundredth")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"reason": "", "cosine": 0.9},
        {"reason": "   ", "cosine": 0.9},
        {"reason": "nothing changed"},
        {"reason": "bad level", "dual_error": 0.005},
        {"reason": "bad cosine", "cosine": 1.5},
        {"reason": "bad abs", "abs_pass": -1.0},
        {"reason": "bad rel_l2", "rel_l2": 0.0},
    ],
)
def test_tolerance_validation(kwargs):
    with pytest.raises(ValueError):
        Tolerance(**kwargs)


def test_worst():
    p = Verdict("pass", "p", "max_abs")
    w1 = Verdict("warning", "w1", "dual_thousandth")
    w2 = Verdict("warning", "w2", "dual_thousandth")
    e = Verdict("error", "e", "cosine")
    assert worst([p, w1, e, w2]) is e
    assert worst([p, w1, w2]) is w1  # first among equals
    assert worst(iter([p])) is p
    with pytest.raises(ValueError):
        worst([])


def test_verdict_status_is_validated():
    with pytest.raises(ValueError):
        Verdict("ok", "x", "y")


def test_single_element_skips_the_cosine_rule():
    """One element: cosine is a sign test (msprobe does not compute it); a zero reference must
    not force an error when the error is within fp32's resolution at the small-value threshold
    (rel_l2 = 1e-12 / 2**-20 ~ 1e-6 < 64 u)."""
    c = compare(torch.tensor([1e-12]), torch.tensor([0.0], dtype=torch.float64), torch.float32)
    assert c.cosine is None
    assert verdict(c).status == "pass"
    two = compare(
        torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0], dtype=torch.float64), torch.float32
    )
    assert verdict(two).status == "error" and verdict(two).rule == "cosine"


# --------------------------------------------------------------------------- relative L2 rule


def _grad(scale: float, n: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=F64) * scale


@pytest.mark.parametrize("factor", [2.0, 0.5])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_scaled_small_gradient_is_an_error_in_every_dtype(dtype, factor):
    """A 2x error on a gradient of magnitude 1e-4, or halved moments (halved gradients into
    AdamW): max abs error < 1e-3 and cosine 1, so the msprobe shortcut would pass them; the
    relative L2 rule does not."""
    ref = _grad(1e-4)
    want = ref.to(dtype).to(F64 if dtype is F32 else F32)
    c = compare((ref * factor).to(dtype), want, dtype)
    assert c.max_abs_error < 1e-3 and c.cosine > 0.99
    v = verdict(c)
    assert (v.status, v.rule) == ("error", "rel_l2")


def test_six_percent_error_on_five_percent_of_elements_is_an_error():
    ref = _grad(3e-3, n=1000)
    bad = ref.clone()
    bad[:50] *= 1.06
    for dtype in (F32, F16):
        want = ref.to(dtype).to(F64 if dtype is F32 else F32)
        c = compare(bad.to(dtype), want, dtype)
        assert c.max_abs_error < 1e-3
        assert (verdict(c).status, verdict(c).rule) == ("error", "rel_l2"), dtype


def test_correct_rounding_passes_the_relative_rule():
    ref = _grad(1.0, n=4096)
    for dtype in (F32, F16, BF16):
        want = ref.to(F64 if dtype is F32 else F32)
        c = compare(ref.to(dtype), want, dtype)
        assert c.rel_l2 <= torch.finfo(dtype).eps / 2  # one rounding: at most u
        assert verdict(c, hard_only=True) is None
