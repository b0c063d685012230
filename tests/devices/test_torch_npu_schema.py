"""The emulation and every kernel call of the adaptor answer to torch_npu's own schemas.

The committed schema file (``megatron_npu/devices/torch_npu_schemas.txt``) is held equal to the
codegen yaml of the pinned torch_npu wheel, downloaded once into a cache outside the checkout and
never installed; the argument names the binding exposes are checked against the operator schemas
compiled into the wheel's library. Without a reachable package index the two wheel tests skip,
by name, except under CI, where they fail.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import megatron_npu
from megatron_npu import info, patcher
from megatron_npu.devices import Device, make, torch_npu_schema, torch_npu_wheel
from megatron_npu.devices.cpu import CpuAccelerator
from megatron_npu.devices.facts import NPU
from megatron_npu.registry import all_patches
from megatron_npu.testing import torch_npu_emulation as emulation

PACKAGE = Path(megatron_npu.__file__).resolve().parent


@pytest.fixture(scope="module")
def wheel() -> Path:
    version = torch_npu_schema.pinned_version()
    try:
        return torch_npu_wheel.download(version)
    except torch_npu_wheel.WheelUnavailableError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"torch_npu {version} wheel not downloadable here (no package index): {exc}")


def test_the_schema_file_is_the_pinned_wheels(wheel):
    version = torch_npu_schema.pinned_version()
    assert torch_npu_schema.pinned_requirement() == version, (
        "the schema file and pyproject's npu extra name different torch_npu releases"
    )
    committed = torch_npu_wheel.schema_path().read_text(encoding="utf-8")
    assert committed == torch_npu_wheel.render(wheel, version), (
        "torch_npu_schemas.txt differs from the wheel: run "
        "python -m megatron_npu.devices.torch_npu_wheel"
    )


def test_binding_names_are_the_ones_torch_npu_registers(wheel):
    """torchgen's Python form of each schema (``self`` read as ``input``, ...) names the
    arguments as the operator schemas registered by the wheel's library do."""
    registered = torch_npu_wheel.registered_schemas(wheel)
    compared = 0
    for name in sorted(torch_npu_schema.kernel_names() & registered.keys()):
        base = next(
            (
                o
                for o in torch_npu_schema.overloads(name)
                if not o.has_out and o.schema.startswith(name + "(")
            ),
            None,
        )
        if base is None:
            continue
        theirs = [arg.split("=")[0].split()[-1] for arg in _arguments(registered[name])]
        # a factory's Python binding adds requires_grad to the schema's tensor options
        ours = [p for p in base.signature.parameters if p in theirs or p != "requires_grad"]
        if ours[:1] == ["self"] and theirs[:1] == ["input"] and "[] self" in base.schema:
            # the registered schema calls every self 'input'; torchgen's binding renames only a
            # Tensor or Scalar self, so a Tensor[] self keeps its name in Python
            theirs[0] = "self"
        assert ours == theirs, f"{name}: {ours} vs registered {registered[name]}"
        compared += 1
    used = set(emulation.KERNELS)
    assert used <= registered.keys(), f"not registered: {sorted(used - registered.keys())}"
    assert compared > 200, compared


def _arguments(schema: str) -> list[str]:
    inner = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    args, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth == 0:
            args.append(inner[start:i].strip())
            start = i + 1
    args.append(inner[start:].strip())
    return [a for a in args if a and a != "*"]


# ----------------------------------------------------------------------- the emulation


def _params(signature: inspect.Signature) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def signature_mismatch(fn, name: str) -> str | None:
    """None when ``fn``'s signature is one overload's Python form of kernel ``name`` (same
    parameters, order, keyword-only split and defaults; an emulation that serves only the
    ``out=`` form may make ``out`` required), else what the overloads look like."""
    ours = inspect.signature(fn)
    forms = []
    for overload in torch_npu_schema.overloads(name):
        theirs = overload.signature
        if overload.has_out and overload.out_name in ours.parameters:
            theirs = theirs.replace(
                parameters=[
                    p.replace(default=inspect.Parameter.empty) if p.name == overload.out_name else p
                    for p in theirs.parameters.values()
                ]
            )
        if _params(ours) == _params(theirs):
            return None
        forms.append(str(theirs))
    return f"{name}{ours} matches no overload: {forms}"


@pytest.mark.parametrize("name", emulation.KERNELS)
def test_each_emulated_kernel_has_the_real_signature(name):
    assert signature_mismatch(getattr(emulation, name), name) is None


def _planted(fn, how: str):
    """A stand-in with ``fn``'s signature changed the way ``how`` says (None: not applicable)."""
    params = list(inspect.signature(fn).parameters.values())
    if how == "renamed":
        params[0] = params[0].replace(name=params[0].name + "_")
    elif how == "reordered":
        if len(params) < 2 or params[1].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return None
        params[0], params[1] = params[1], params[0]
    elif how == "made-positional":
        if not any(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params):
            return None
        params = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params]
    elif how == "dropped":
        params = params[1:]

    def stub(*args, **kwargs):  # noqa: ARG001 - only its signature is read
        return None

    stub.__signature__ = inspect.Signature(params, __validate_parameters__=False)
    return stub


@pytest.mark.parametrize("how", ["renamed", "reordered", "made-positional", "dropped"])
def test_the_signature_check_fails_on_a_planted_change(how):
    planted = 0
    for name in emulation.KERNELS:
        stub = _planted(getattr(emulation, name), how)
        if stub is None:
            continue
        assert signature_mismatch(stub, name) is not None, (name, how)
        planted += 1
    assert planted >= 2, f"{how}: planted in {planted} kernels only"


def _examples() -> dict[str, tuple[tuple, dict, bool]]:
    """A valid call of every emulated kernel: (args, kwargs, uses out=)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.rand(*shape, generator=g)

    var, m, v = rand(6), torch.zeros(6), torch.zeros(6)
    angle = rand(1, 4, 1, 8)
    return {
        "npu_fusion_attention": (
            (rand(2, 4, 16), rand(2, 4, 16), rand(2, 4, 16), 2, "BSH"),
            {"scale": 0.25},
            False,
        ),
        "npu_fusion_attention_grad": (
            (rand(2, 4, 16), rand(2, 4, 16), rand(2, 4, 16), rand(2, 4, 16), 2, "BSH"),
            {
                "softmax_max": torch.zeros(2, 2, 4, 8),
                "softmax_sum": torch.full((2, 2, 4, 8), 4.0),
                "attention_in": rand(2, 4, 16),
                "scale_value": 0.25,
            },
            False,
        ),
        "npu_ring_attention_update": (
            (
                rand(4, 2, 16),
                torch.zeros(2, 2, 4, 8),
                torch.ones(2, 2, 4, 8),
                rand(4, 2, 16),
                torch.zeros(2, 2, 4, 8),
                torch.ones(2, 2, 4, 8),
            ),
            {"input_layout": "SBH"},
            False,
        ),
        "npu_rms_norm": ((rand(3, 8), torch.ones(8)), {"epsilon": 1e-5}, False),
        "npu_swiglu": ((rand(3, 8),), {"dim": -1}, False),
        "npu_rotary_mul": ((rand(2, 4, 3, 8), angle.cos(), angle.sin()), {}, False),
        "npu_scaled_masked_softmax": (
            (rand(1, 1, 32, 32), torch.zeros(1, 1, 32, 32, dtype=torch.bool), 0.5, False),
            {},
            False,
        ),
        "npu_fast_gelu": ((rand(5),), {}, False),
        "npu_gelu": ((rand(5),), {"approximate": "tanh"}, False),
        "npu_grouped_matmul": (
            ([rand(5, 4)], [rand(2, 4, 3)]),
            {
                "group_list": torch.tensor([2, 3]),
                "split_item": 3,
                "group_type": 0,
                "group_list_type": 1,
            },
            False,
        ),
        "npu_apply_adam_w": (
            (0.9, 0.999, 1e-3, 0.0, 0.9, 0.999, 1e-8, rand(6), None, False, False),
            {"out": (var, m, v)},
            True,
        ),
        "npu_moe_gating_top_k": (
            (rand(3, 8), 2),
            {
                "bias": rand(8),
                "k_group": 2,
                "group_count": 4,
                "group_select_mode": 1,
                "norm_type": 1,
                "out_flag": True,
            },
            False,
        ),
        "npu_moe_gating_top_k_backward": (
            (rand(3, 8), rand(3, 2), torch.tensor([[0, 1]] * 3, dtype=torch.int32)),
            {"norm_type": 1, "routed_scaling_factor": 2.5},
            False,
        ),
        "npu_moe_token_permute_with_routing_map": (
            (rand(3, 4), torch.ones(3, 2, dtype=torch.int8)),
            {"num_out_tokens": 6},
            False,
        ),
        "npu_moe_token_unpermute_with_routing_map": (
            (rand(6, 4), torch.tensor([0, 3, 1, 4, 2, 5], dtype=torch.int32), [3, 4]),
            {"probs": rand(3, 2), "routing_map": torch.ones(3, 2, dtype=torch.bool)},
            False,
        ),
    }


def test_every_emulated_kernel_has_an_example():
    assert set(_examples()) == set(emulation.KERNELS)


@pytest.mark.parametrize("name", emulation.KERNELS)
def test_each_emulated_kernel_returns_what_the_real_one_returns(name):
    args, kwargs, out = _examples()[name]
    result = getattr(emulation, name)(*args, **kwargs)
    arity = len(result) if isinstance(result, tuple) else 1
    assert arity == torch_npu_schema.returns(name, out=out)


REJECTED = {
    "keyword-only passed by position": ("npu_gelu", lambda x: ((x, "tanh"), {})),
    "the binding calls self 'input'": ("npu_rms_norm", lambda x: ((), {"x": x, "gamma": x})),
    "another name for self": ("npu_swiglu", lambda x: ((), {"x": x})),
    "unknown keyword": ("npu_rotary_mul", lambda x: ((x, x, x), {"mode": "half"})),
    "float for int": ("npu_fusion_attention", lambda x: ((x, x, x, 2.0, "BSH"), {})),
    "str for bool": ("npu_scaled_masked_softmax", lambda x: ((x, x, 1.0, "no"), {})),
    "required argument missing": ("npu_fast_gelu", lambda x: ((), {})),
    "arguments reordered": ("npu_fusion_attention", lambda x: ((x, x, x, "BSH", 2), {})),
    "keyword dropped from a call": (
        "npu_apply_adam_w",
        lambda x: ((0.9, 0.999, 1e-3, 0.0, 0.9, 0.999, 1e-8, x, None, False), {"out": (x, x, x)}),
    ),
    "out= of the wrong arity": (
        "npu_apply_adam_w",
        lambda x: (
            (0.9, 0.999, 1e-3, 0.0, 0.9, 0.999, 1e-8, x, None, False, False),
            {"out": (x, x)},
        ),
    ),
    "optional without default is still required": (
        "npu_apply_adam_w",
        lambda x: ((0.9, 0.999, 1e-3, 0.0, 0.9, 0.999, 1e-8, x), {"out": (x, x, x)}),
    ),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_the_emulation_rejects_what_the_kernel_would(case):
    name, make_call = REJECTED[case]
    args, kwargs = make_call(torch.ones(4, 8))
    with pytest.raises(
        torch_npu_schema.KernelCallError,
        match=f"torch_npu.{name} call would "
        f"not bind on torch_npu {torch_npu_schema.pinned_version()}",
    ):
        getattr(emulation, name)(*args, **kwargs)


def test_the_valid_examples_bind():
    for name, (args, kwargs, _) in _examples().items():
        torch_npu_schema.bind(name, args, kwargs)


# ------------------------------------------------------------- the adaptor's kernel calls


# every call site of a kernel in the package runs through the schema check on npu-emulated:
# tests/parity/test_branch_coverage.py (the parity trace records where the calls came from)


def test_registry_kernels_exist_in_the_pinned_release():
    for patch in all_patches():
        for kernel in patch.npu_kernels:
            assert torch_npu_schema.has_kernel(kernel), (patch.id, kernel)


# ------------------------------------------------------ a torch_npu without some kernel


def needing_planned(ids):
    """Those of ``ids`` that apply to the installed megatron-core (the rest are skipped)."""
    version = patcher.megatron_core_version()
    return [p.id for p in all_patches() if p.id in ids and p.applies_to_version(version)]


def _npu_without(kernel: str) -> Device:
    """An ``npu`` device whose torch_npu (the emulation's functions) lacks ``kernel``."""
    kernels = SimpleNamespace(
        **{k: getattr(emulation, k) for k in emulation.KERNELS if k != kernel}
    )
    return Device(
        name=NPU,
        torch_type="cpu",
        dist_backend="gloo",
        accelerator=CpuAccelerator(),
        kernels=kernels,
        kernels_source="torch_npu 2.1.0",
    )


def test_a_patch_needing_a_kernel_the_npu_lacks_is_refused_by_name():
    device = _npu_without("npu_rotary_mul")
    needing = sorted(p.id for p in all_patches() if "npu_rotary_mul" in p.npu_kernels)
    assert needing
    with pytest.raises(patcher.MissingKernelError) as err:
        megatron_npu.apply(device)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("torch_npu 2.1.0 does not have torch_npu.npu_rotary_mul, which ")
    assert all(repr(i) in message for i in needing_planned(needing))
    assert f"checked against torch_npu {torch_npu_schema.pinned_version()}" in message
    assert f"MEGATRON_NPU_DISABLE={','.join(needing_planned(needing))}" in message
    assert patcher.active_device() is None, "a refused apply must leave nothing installed"


def test_info_says_which_patches_lack_their_kernel():
    device = _npu_without("npu_rotary_mul")
    rows = {row["id"]: row for row in info.collect(device)["patches"]}
    needing = {p.id for p in all_patches() if "npu_rotary_mul" in p.npu_kernels}
    planned = {
        i
        for i in needing
        if rows[i]["status"] not in (patcher.SKIPPED_BY_VERSION, patcher.NOT_FOR_DEVICE)
    }
    assert planned, "no patch calling npu_rotary_mul applies to this megatron-core"
    for patch_id in planned:
        assert rows[patch_id]["status"] == patcher.FAILED
        assert "torch_npu.npu_rotary_mul" in rows[patch_id]["reason"]
    assert {i for i, row in rows.items() if row["status"] == patcher.FAILED} == planned
    facts = info.collect(device)["torch_npu_kernels"]
    row = next(r for r in facts["kernels"] if r["name"] == "npu_rotary_mul")
    assert row["in_pinned_torch_npu"] is True and row["on_device"] is False
    assert facts["missing"] == ["npu_rotary_mul"]


def test_switching_the_patch_off_lets_the_rest_apply():
    device = _npu_without("npu_rotary_mul")
    needing = tuple(p.id for p in all_patches() if "npu_rotary_mul" in p.npu_kernels)
    results = megatron_npu.apply(device, disable=needing)
    try:
        assert not [r for r in results if r.status == patcher.FAILED]
    finally:
        megatron_npu.restore()


def test_the_emulated_device_has_every_kernel_and_says_what_it_is():
    device = make("npu-emulated")
    assert device.missing_kernels({k for p in all_patches() for k in p.npu_kernels}) == []
    assert device.kernels_source == (
        f"the emulation of torch_npu {torch_npu_schema.pinned_version()}"
    )
