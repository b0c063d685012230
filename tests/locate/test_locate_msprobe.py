"""``megatron-npu locate --msprobe REF CAND`` on real msprobe dumps made here on the CPU
(``mindstudio-probe``'s ``PrecisionDebugger``, levels L0, L1 and mix, tasks tensor and
statistics) of one training step of a small Llama-style stack, the candidate with a 2 % error
planted in one norm, or for L1 in the ``rsqrt`` kernel (tests/locate/_msprobe_dump.py): every
later row inherits the error, and locate names the norm or API call that made it; a healthy
pair names nothing; statistics-only dumps name it with the statement of what statistics can
conclude, and their error figures are lower bounds."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from once_per_run import built_once
from planting import plant_env

from megatron_npu.locate import command, modules, msprobe_dumps
from megatron_npu.locate.modules import tensor_error

pytestmark = pytest.mark.slow

MAKE = Path(__file__).with_name("_msprobe_dump.py")
PLANTED = "Module.layers.1.norm.RMSNorm.forward.0"
DUMPS = {  # name -> (level, task, what is planted)
    "ref-L0-tensor": ("L0", "tensor", None),
    "cand-L0-tensor": ("L0", "tensor", "--plant"),
    "ref2-L0-tensor": ("L0", "tensor", None),
    "ref-mix-tensor": ("mix", "tensor", None),
    "cand-mix-tensor": ("mix", "tensor", "--plant"),
    "ref-L0-statistics": ("L0", "statistics", None),
    "cand-L0-statistics": ("L0", "statistics", "--plant"),
    "ref-L1-tensor": ("L1", "tensor", None),
    "cand-L1-tensor": ("L1", "tensor", "--plant-kernel"),
}


@pytest.fixture(scope="module")
def dumps(xdist_shared) -> Path:
    def build(root: Path) -> None:
        argv = [sys.executable, str(MAKE)]
        for name, (level, task, planted) in DUMPS.items():
            argv += [level, task, str(root / name), *([planted] if planted else []), "--"]
        done = subprocess.run(argv[:-1], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    return built_once(xdist_shared, "msprobe-dumps", build)


def _locate(out: Path, ref: Path, cand: Path) -> dict:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--msprobe", str(ref), str(cand), "--out", str(out)])
    data = command.locate_msprobe(args).to_data()
    assert json.loads((out / msprobe_dumps.RESULT_FILE).read_text()) == data
    return data


@pytest.mark.parametrize("kind", ["L0-tensor", "mix-tensor", "L0-statistics"])
def test_locate_names_the_norm_that_made_the_error(dumps, tmp_path, kind):
    data = _locate(tmp_path, dumps / f"ref-{kind}" / "dump", dumps / f"cand-{kind}" / "dump")
    row = data["divergent"]
    assert (row["name"], row["module"], row["phase"], row["rank"]) == (
        PLANTED,
        PLANTED,
        "forward",
        "step0/rank0",
    )
    assert row["input"] == 0 and row["output"] > row["tolerance"]
    assert row["patches"] == []  # a plain torch model: no adaptor patch reaches it
    rows = {r["name"]: r for r in data["rows"]}
    later = [r for r in data["rows"] if r["name"].startswith("Module.layers.2.")]
    assert later and all(isinstance(r["output"], float) and r["output"] > 0 for r in later)
    assert not any(r["diverges"] for r in later)  # inherited, explained by their inputs
    if kind.endswith("statistics"):
        assert data["task"] == "statistics" and "lower bound" in data["statement"]
    else:
        assert data["task"] == "tensor" and data["statement"] is None
        assert math.isclose(rows[PLANTED]["output"], 0.01396, rel_tol=0.05)
        # what msprobe compare shows for that row: its cosine passes, the 2 % is in max rel err
        metrics = row["msprobe_metrics"]
        assert metrics["cosine"] > modules.MSPROBE_COSINE
        assert math.isclose(metrics["max_rel_error"], 0.02, rel_tol=1e-3)
    if kind.startswith("mix"):  # the APIs inside the module were compared too
        assert any(r["kind"] == "api" and r["module"] == PLANTED for r in data["rows"])


def test_an_api_level_dump_names_the_faulty_kernel(dumps, tmp_path):
    """msprobe's default level, L1, records API calls alone (no module rows, no construct.json
    parents): the planted ``torch.rsqrt`` is named at its first call, from inputs that agree, and
    the rows after it that inherit its error are not."""
    data = _locate(tmp_path, dumps / "ref-L1-tensor" / "dump", dumps / "cand-L1-tensor" / "dump")
    assert data["levels"] == ["L1"] and not data["unmatched"]
    row = data["divergent"]
    assert (row["name"], row["kind"], row["phase"], row["input"]) == (
        "Torch.rsqrt.0.forward",
        "api",
        "forward",
        0,
    )
    assert math.isclose(row["output"], 0.0136, rel_tol=0.05)
    assert all(r["kind"] == "api" for r in data["rows"])
    after = [r for r in data["rows"] if r["name"].startswith("Functional.linear.")]
    assert after and all(r["output"] > 0 and not r["diverges"] for r in after)


def test_two_healthy_runs_name_nothing(dumps, tmp_path):
    data = _locate(tmp_path, dumps / "ref-L0-tensor" / "dump", dumps / "ref2-L0-tensor" / "dump")
    assert data["divergent"] is None and len(data["rows"]) > 30 and not data["unmatched"]


def test_a_step_folder_or_a_dump_json_is_taken_as_the_dump(dumps, tmp_path):
    ref = next((dumps / "ref-L0-tensor" / "dump").rglob("dump.json"))
    cand = dumps / "cand-L0-tensor" / "dump" / "step0"
    assert _locate(tmp_path, ref, cand)["divergent"]["name"] == PLANTED


def test_not_a_dump_is_one_named_error(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--msprobe", str(tmp_path), str(tmp_path), "--out", str(tmp_path)])
    assert command.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megatron-npu locate: {tmp_path}: no dump.json under it: not an msprobe dump"]


@pytest.mark.parametrize(
    "data", [{}, {"Aten.native_layer_norm.default.0.forward": {}}], ids=["empty", "unread-level"]
)
def test_a_dump_with_nothing_to_compare_is_one_named_error(tmp_path, capsys, data):
    """A dump whose rows locate cannot read (none, or another level's names) would otherwise
    compare nothing and name nothing, as if the two runs agreed."""
    dump = tmp_path / "dump" / "step0" / "rank0" / "dump.json"
    dump.parent.mkdir(parents=True)
    dump.write_text(json.dumps({"task": "tensor", "level": "L2", "data": data}))
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--msprobe", str(dump), str(dump), "--out", str(tmp_path / "o")])
    assert command.main(args) == 2
    first = f"first row {next(iter(data))!r}" if data else "no rows"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"megatron-npu locate: {dump}: no module or API call to compare (level 'L2', {first}): "
        "locate reads msprobe's levels L0, L1 and mix, whose rows are named "
        "Module.<path>.<Class>.<phase>.<n> and <Api>.<name>.<n>.<phase>"
    ]


def test_the_patches_a_row_reaches_come_from_the_registry():
    """Megatron's module and API names map to the patches whose targets or kernels they are."""
    layer = "Module.decoder.layers.0"
    assert msprobe_dumps.patches_reaching(f"{layer}.input_layernorm.TENorm.forward.0") == [
        "transformer-engine.gpt-spec-norm",
        "transformer-engine.norm",
    ]
    softmax = f"{layer}.self_attention.core_attention.scale_mask_softmax"
    assert "softmax.fused" in msprobe_dumps.patches_reaching(
        f"{softmax}.FusedScaleMaskSoftmax.forward.0"
    )
    assert "transformer-engine.norm" in msprobe_dumps.patches_reaching("NPU.npu_rms_norm.0.forward")
    # F.linear is wrapped on the CPU stand-ins (16-bit products in fp32); dropout is not patched
    assert msprobe_dumps.patches_reaching("Functional.linear.0.forward") == [
        "matmul.functional-linear"
    ]
    assert msprobe_dumps.patches_reaching("Functional.dropout.0.forward") == []


@pytest.mark.parametrize("seed", range(6))
def test_statistics_give_a_lower_bound_of_the_error(seed):
    generator = torch.Generator().manual_seed(seed)
    ref = torch.randn(64, 16, generator=generator)
    cand = ref + torch.randn(64, 16, generator=generator) * 10 ** (-seed)

    def info(t: torch.Tensor) -> msprobe_dumps.TensorInfo:
        stats = {
            "Max": t.max().item(),
            "Min": t.min().item(),
            "Mean": t.mean().item(),
            "Norm": t.norm().item(),
        }
        return msprobe_dumps.TensorInfo(tuple(t.shape), "torch.float32", stats, None)

    bound = msprobe_dumps.statistics_bound(info(cand), info(ref))
    assert 0 < bound <= tensor_error(cand, ref) * (1 + 1e-6)


def _main(ref: Path, cand: Path, out: Path, capsys) -> tuple[int, list[str]]:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    status = command.main(parser.parse_args(["--msprobe", str(ref), str(cand), "--out", str(out)]))
    return status, capsys.readouterr().err.strip().splitlines()


def _copy(dumps: Path, name: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of dump ``name`` and the dump.json of its one rank."""
    import shutil

    copy = tmp_path / name
    shutil.copytree(dumps / name / "dump", copy)
    return copy, next(copy.rglob("dump.json"))


def _edit(dump_json: Path, change) -> None:
    document = json.loads(dump_json.read_text())
    change(document["data"])
    dump_json.write_text(json.dumps(document))


@pytest.mark.parametrize(
    "mismatch",
    ["statistics-side", "missing-file", "other-step", "other-model-rows", "other-model-shape"],
)
def test_mismatched_dumps_are_one_named_error(dumps, tmp_path, capsys, mismatch):
    ref = dumps / "ref-L0-tensor" / "dump"
    cand, dump_json = _copy(dumps, "cand-L0-tensor", tmp_path)
    if mismatch == "statistics-side":
        cand = dumps / "cand-L0-statistics" / "dump"
        expected = "the reference is a tensor dump and the candidate a statistics dump"
    elif mismatch == "missing-file":
        victim = sorted((dump_json.parent / "dump_tensor_data").iterdir())[3]
        victim.unlink()
        expected = f"{victim}: a tensor file its dump.json names is missing"
    elif mismatch == "other-step":
        step = next(cand.rglob("step0"))
        step.rename(step.with_name("step1"))
        expected = "the dumps hold other steps or ranks"
    elif mismatch == "other-model-rows":  # a model without layer 1's norm
        _edit(dump_json, lambda data: [data.pop(k) for k in list(data) if ".layers.1.norm." in k])
        expected = "the dumps are of other models: Module.layers.1.norm."
    else:  # a wider layer 0 norm weight in the candidate

        def widen(data):
            row = next(
                v
                for k, v in data.items()
                if k.startswith("Module.layers.0.norm.") and k.endswith("forward.0")
            )
            next(t for t in row["output"] if isinstance(t, dict))["shape"][-1] += 1

        _edit(dump_json, widen)
        expected = "the dumps are of other models: Module.layers.0.norm."
    status, err = _main(ref, cand, tmp_path / "out", capsys)
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("megatron-npu locate: ") and expected in err[0], err[0]


def test_a_module_served_by_another_class_is_still_paired(dumps, tmp_path):
    """A port may serve a module with another class (the adaptor's norm where a GPU ran apex's):
    rows pair by module path, phase and call, and the planted norm is named under its new
    class."""
    cand, dump_json = _copy(dumps, "cand-L0-tensor", tmp_path)
    renamed = {}

    def rename(data):
        for key in list(data):
            if ".RMSNorm." in key:
                renamed[key] = key.replace(".RMSNorm.", ".NpuRMSNorm.")
                data[renamed[key]] = data.pop(key)

    _edit(dump_json, rename)
    construct = dump_json.with_name("construct.json")
    if construct.is_file():
        parents = json.loads(construct.read_text())
        construct.write_text(
            json.dumps({renamed.get(k, k): renamed.get(v, v) for k, v in parents.items()})
        )
    data = _locate(tmp_path / "out", dumps / "ref-L0-tensor" / "dump", cand)
    assert data["divergent"]["name"] == PLANTED.replace(".RMSNorm.", ".NpuRMSNorm.")
    assert not data["unmatched"]


def msprobe_compare(target: Path, golden: Path, out: Path) -> dict[str, dict[str, str]]:
    """Run msprobe's own ``msprobe compare -tp TARGET -gp GOLDEN`` (each a ``step<N>`` folder)
    and read its result table: tensor name -> its row (``Cosine``, ``MaxAbsErr``,
    ``MaxRelativeErr``, ``Result``, ...)."""
    import csv
    import shutil

    binary = shutil.which("msprobe") or str(Path(sys.executable).with_name("msprobe"))
    done = subprocess.run(
        [binary, "compare", "-tp", str(target), "-gp", str(golden), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [table] = out.glob("compare_result_*.csv")
    with table.open(newline="") as f:
        return {row["NPU Name"]: row for row in csv.DictReader(f)}


def test_msprobe_compare_passes_every_row_that_locate_names(dumps, tmp_path):
    """msprobe's own comparison of the planted pair marks every row ``pass``, the planted norm's
    output included (cosine 0.99995, the 2 % only in its max relative error), while locate names
    that norm."""
    ref, cand = dumps / "ref-L0-tensor" / "dump", dumps / "cand-L0-tensor" / "dump"
    table = msprobe_compare(cand / "step0", ref / "step0", tmp_path / "compare")
    assert table and {row["Result"] for row in table.values()} == {"pass"}
    planted = table[f"{PLANTED}.output.0"]
    assert float(planted["Cosine"]) > 0.9999 and math.isclose(
        float(planted["MaxRelativeErr"]), 0.02, rel_tol=1e-3
    )
    assert _locate(tmp_path / "locate", ref, cand)["divergent"]["name"] == PLANTED


MEGATRON_MAKE = Path(__file__).with_name("_msprobe_megatron_dump.py")
MEGATRON_NORM = "Module.decoder.layers.0.input_layernorm.Norm.forward.0"


@pytest.fixture(scope="module")
def megatron_dumps(xdist_shared) -> Path:
    """A Megatron-Core GPT's step dumped by msprobe on cpu (reference) and through the adaptor's
    NPU path on npu-emulated with the emulated ``npu_rms_norm`` kernel 2 % off (candidate)."""
    import os

    def build(root: Path) -> None:
        for device, plant in (("cpu", None), ("npu-emulated", "rms-norm-2pct")):
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            if plant:
                env.update(plant_env(plant))
            done = subprocess.run(
                [sys.executable, str(MEGATRON_MAKE), device, str(root / device)],
                capture_output=True,
                text=True,
                timeout=300,
                env=env,
            )
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    return built_once(xdist_shared, "msprobe-megatron-dumps", build)


def test_a_planted_kernel_on_the_npu_path_is_named_with_its_patch(megatron_dumps, tmp_path):
    """cpu against npu-emulated, a Megatron-Core GPT through the adaptor, the NPU norm kernel 2 %
    off: locate names the first layer's input norm (every later row inherits the error) and the
    patch that builds it and calls the kernel; msprobe's own cosine for that row passes its 0.99
    threshold."""
    ref, cand = megatron_dumps / "cpu" / "dump", megatron_dumps / "npu-emulated" / "dump"
    data = _locate(tmp_path / "locate", ref, cand)
    row = data["divergent"]
    assert (row["name"], row["phase"]) == (MEGATRON_NORM, "forward"), row
    assert row["input"] == 0 and math.isclose(row["output"], 0.02, rel_tol=0.05)
    assert row["patches"] == ["norm.wrapped-torch-norm"]
    assert row["msprobe_metrics"]["cosine"] > modules.MSPROBE_COSINE
    later = [r for r in data["rows"] if ".layers.1." in r["name"]]
    assert later and not any(r["diverges"] for r in later)
    table = msprobe_compare(cand / "step0", ref / "step0", tmp_path / "compare")
    assert float(table[f"{MEGATRON_NORM}.output.0"]["Cosine"]) > 0.9999


def test_msprobe_compare_reads_locates_own_dumps_and_agrees_on_the_named_module(tmp_path):
    """locate's dump folders are msprobe dumps: ``msprobe compare`` reads a pair of them and
    shows, for the tensor that gave locate's first divergent module its error, the cosine and
    max absolute and relative errors locate reports beside its verdict."""
    from test_locate_units import _dump

    from megatron_npu.locate import dump

    ref, bad = _dump(tmp_path, "ref"), _dump(tmp_path, "bad", "norm-forward", bug_layer=1)
    first = modules.compare_dumps(ref, bad).first_dict()
    assert first["module"] == "decoder.layers.1" and first["phase"] == "forward"
    measured = first["msprobe"]
    table = msprobe_compare(bad, ref, tmp_path / "compare")
    index, _ = dump.read_rank(bad, 0)
    assert len(table) == sum(e.module != dump.OPTIMIZER for e in index.entries)
    row = table[measured["data_name"].removesuffix(".pt")]
    assert float(row["Cosine"]) == pytest.approx(measured["cosine"], abs=1e-6)
    assert float(row["MaxAbsErr"]) == pytest.approx(measured["max_abs_error"], rel=1e-4)
    assert float(row["MaxRelativeErr"].rstrip("%")) / (
        100 if "%" in row["MaxRelativeErr"] else 1
    ) == pytest.approx(measured["max_rel_error"], rel=1e-3)
    # msprobe compare passes the row that locate names (its inputs do not explain its error)
    assert row["Result"] == "pass"
