"""locate's pieces on synthetic data: curves -> step, dumps of a small torch model -> module,
delta debugging -> patch, locate.json and its report section. No training run, no subprocess."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from megatron_npu.compare import rules
from megatron_npu.formats import FormatError
from megatron_npu.formats.locate_result import FILENAME, SCHEMA_VERSION, LocateResult
from megatron_npu.locate import command, curves, dump, modules
from megatron_npu.locate.culprit import ddmin, search

# ------------------------------------------------------------------ first divergent step


def _curve(losses, norms):
    its = list(range(1, len(losses) + 1))
    return rules.Curve(its, list(losses), list(norms), [0.0] * len(its))


def test_first_divergent_step_is_the_first_beyond_the_approximate_rtol():
    ref = _curve([5.0, 4.0, 3.0, 2.5], [1.0, 1.0, 1.0, 1.0])
    cand = _curve([5.0, 4.04, 3.3, 3.0], [1.0, 1.0, 1.0, 1.0])  # 1 %, 10 %, 20 %
    found = curves.first_divergent_step(ref, cand)
    assert (found.step, found.quantity) == (3, "loss")
    assert found.rel_error == pytest.approx(0.1)
    assert found.approximate["status"] == rules.FAIL


def test_a_grad_norm_beyond_the_rule_counts_before_a_later_loss():
    ref = _curve([5.0, 4.0, 3.0], [1.0, 1.0, 1.0])
    cand = _curve([5.0, 4.0, 3.6], [1.0, 1.5, 1.0])
    found = curves.first_divergent_step(ref, cand)
    assert (found.step, found.quantity) == (2, "grad_norm")


def test_small_errors_fall_back_to_mean_rtol_then_the_floor():
    ref = _curve([5.0, 5.0, 5.0], [1.0, 1.0, 1.0])
    assert curves.first_divergent_step(ref, _curve([5.0, 5.15, 5.0], [1.0] * 3)).step == 2
    found = curves.first_divergent_step(ref, _curve([5.0, 5.0, 5.005], [1.0] * 3))
    assert (found.step, found.threshold) == (3, curves.FLOOR)


def test_agreeing_curves_have_no_divergent_step():
    ref = _curve([5.0, 4.0], [1.0, 0.9])
    found = curves.first_divergent_step(ref, _curve([5.0 * (1 + 1e-7), 4.0], [1.0, 0.9]))
    assert found.step is None and found.approximate["status"] == rules.PASS


def test_curves_of_different_steps_are_a_named_error():
    with pytest.raises(curves.CurveError, match="different steps"):
        curves.first_divergent_step(_curve([1.0, 2.0], [1, 1]), _curve([1.0], [1]))


def test_a_locate_curve_keeps_a_diverged_loss_and_names_a_bad_one(tmp_path):
    from megatron_npu.formats.locate_curve import LocateCurve

    path = tmp_path / "reference.json"
    written = LocateCurve.empty()
    for step, loss in ((1, 5.0), (2, float("nan")), (3, None)):
        written.add(step, loss, 0.5)
    written.write(path)
    assert json.loads(path.read_text())["losses"] == [5.0, "NaN", None]  # strict JSON
    curve = curves.read_curve(path)
    assert curve.iterations == [1, 2, 3] and math.isnan(curve.losses[1])
    assert curve.losses[2] is None
    path.write_text(json.dumps({"iterations": [1, 2], "losses": [5.0], "grad_norms": [1, 1]}))
    with pytest.raises(curves.CurveError, match=r"^not a locate curve: .*: losses: holds 1 val"):
        curves.read_curve(path)


def test_read_curve_takes_train_metrics_json(tmp_path):
    path = tmp_path / "metrics.json"
    step = {"step": 1, "lm_loss": 2.0, "grad_norm": 0.5}
    path.write_text(json.dumps({"config": {"arguments": {}}, "steps": [step]}))
    curve = curves.read_curve(path)
    assert (curve.iterations, curve.losses, curve.grad_norms) == ([1], [2.0], [0.5])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(curves.CurveError, match="neither"):
        curves.read_curve(tmp_path / "bad.json")
    path.write_text(json.dumps({"config": {"arguments": {}}, "steps": [{**step, "step": "one"}]}))
    with pytest.raises(curves.CurveError, match=rf"^not a metrics.json: {path}: steps\[0\].step: "):
        curves.read_curve(path)


# ------------------------------------------------------------------ dumps and modules


class Block(torch.nn.Module):
    def __init__(self, width: int, bug: str | None = None) -> None:
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Linear(width, width)
        self.bug = bug

    def forward(self, x):
        h = self.input_layernorm(x)
        if self.bug == "norm-forward":
            h = h * 1.01
        return x + torch.tanh(self.mlp(h))


class Net(torch.nn.Module):
    """Named like Megatron's GPT (embedding, decoder.layers.N, output_layer)."""

    def __init__(self, bug: str | None = None, bug_layer: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Linear(8, 16)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(
            [Block(16, bug if i == bug_layer else None) for i in range(3)]
        )
        self.output_layer = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.embedding(x)
        for layer in self.decoder.layers:
            h = layer(h)
        return self.output_layer(h).pow(2).mean(dim=-1)


def _dump(tmp_path, name, bug=None, bug_layer=0, lr=0.1, limit=dump.DEFAULT_LIMIT):
    net = Net(bug, bug_layer)
    torch.manual_seed(1)
    x = torch.randn(5, 8)
    with dump.Recorder([net], None, limit, num_layers=3) as rec:
        loss = net(x).sum()
        loss.backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= (lr * 1.5 if bug == "update" and p.dim() == 1 else lr) * p.grad
    rec.record_parameters()
    folder = tmp_path / name
    rec.write(folder, 0, {"tp": 0, "pp": 0, "dp": 0})
    dump.write_meta(folder, step=1, world=1, dtype="float32")
    return folder


def test_a_clean_pair_has_no_divergent_module(tmp_path):
    comp = modules.compare_dumps(_dump(tmp_path, "a"), _dump(tmp_path, "b"))
    assert comp.first is None
    assert {r.module for r in comp.rows} >= {"embedding", "decoder.layers.2.mlp", "model"}


def test_the_first_module_whose_error_its_inputs_do_not_explain_is_named(tmp_path):
    comp = modules.compare_dumps(
        _dump(tmp_path, "ref"), _dump(tmp_path, "bad", "norm-forward", bug_layer=1)
    )
    row, phase = comp.first
    # the norm is right; the block's own code scales its output: layer 1 (not layer 0, whose
    # output agrees, nor layer 2 or the output layer, whose error their inputs explain)
    assert (row.module, phase) == ("decoder.layers.1", "forward")
    by_name = {r.module: r for r in comp.rows}
    later = by_name["decoder.layers.2.mlp"].phases["forward"]
    assert later.output > later.tolerance and not later.diverges  # inherited, not its own
    assert by_name["decoder.layers.0"].phases["forward"].output == 0.0


def test_an_update_bug_is_named_in_the_update_phase(tmp_path):
    comp = modules.compare_dumps(_dump(tmp_path, "ref"), _dump(tmp_path, "upd", "update"))
    row, phase = comp.first
    assert phase == "update" and row.module == "embedding"  # the first module with a bias


def test_the_tolerance_grows_with_depth_and_gain_bounds_inherited_error():
    rule = modules.Rule(1e-5, growth=0.5, gain=10.0)
    assert rule.tolerance(4) == pytest.approx(3e-5)
    assert rule.diverges(1e-4, 0.0, 0) and not rule.diverges(2e-5, 0.0, 4)
    assert not rule.diverges(1e-3, 1e-4, 0)  # 10x its inputs: explained
    assert rule.diverges(1e-2, 1e-4, 0)


def test_base_tolerance_follows_the_parity_bound_of_the_dtype():
    from megatron_npu.parity.metrics import dtype_config

    for name in ("float32", "bfloat16", "float16"):
        expected = modules.BASE_MULTIPLE * dtype_config(name).rel_l2_bound
        assert modules.rule_for(name).base == expected


def test_large_tensors_are_sampled_identically_on_both_runs(tmp_path):
    t = torch.arange(10_000, dtype=torch.float32)
    fields, stored = dump.summarize(t, 100)
    assert fields["sampled"] and stored.numel() == 100
    assert fields["stats"]["max"] == 9999.0 and fields["stats"]["numel"] == 10_000
    _, again = dump.summarize(t.clone(), 100)
    assert torch.equal(stored, again)
    steps = torch.diff(stored)
    assert len(set(steps.tolist())) > 1  # not a fixed stride


def test_dump_reads_back_with_weights_only_and_rejects_other_folders(tmp_path):
    folder = _dump(tmp_path, "a", limit=16)
    index, tensors = dump.read_rank(folder, 0)
    assert all(e.key in tensors for e in index.entries)
    assert any(e.sampled for e in index.entries)
    with pytest.raises(dump.DumpError, match="not a locate dump"):
        dump.read_meta(tmp_path / "nowhere")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / dump.META_FILE).write_text('{"format": "x"}')
    with pytest.raises(dump.DumpError, match="not a megatron-npu-locate-dump"):
        dump.read_meta(tmp_path / "other")
    meta = {"format": dump.DUMP_FORMAT, "version": dump.DUMP_VERSION, "step": "two"}
    (tmp_path / "other" / dump.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(dump.DumpError, match=r"locate-dump.json: step: "):
        dump.read_meta(tmp_path / "other")


def test_an_index_reads_back_as_written_and_a_bad_field_is_named(tmp_path):
    from megatron_npu.formats.locate_dump import DumpIndex

    folder = _dump(tmp_path, "a", limit=16)
    path = folder / "rank0" / dump.INDEX_FILE
    text = path.read_text()
    assert DumpIndex.read(path).to_json() == text
    data = json.loads(text)
    data["entries"][2]["order"] = "late"
    path.write_text(json.dumps(data))
    with pytest.raises(dump.DumpError) as bad:
        dump.read_rank(folder, 0)
    assert str(bad.value).startswith(f"{path}: unreadable rank dump (entries[2].order: ")
    assert "'late'" in str(bad.value)


def test_tensor_error_uses_parity_rel_l2():
    ref = torch.ones(100)
    assert modules.tensor_error(ref.clone(), ref) == 0.0
    assert modules.tensor_error(ref * 1.01, ref) == pytest.approx(0.01, rel=1e-4)
    assert math.isinf(modules.tensor_error(torch.ones(3), torch.ones(4)))
    nan = ref.clone()
    nan[0] = float("nan")
    assert math.isinf(modules.tensor_error(nan, ref))


def test_module_kinds():
    assert dump.module_kind("decoder.layers.0.input_layernorm") == "norm"
    assert dump.module_kind("decoder.layers.3.self_attention.core_attention") == "attention"
    assert dump.module_kind("decoder.layers.0.mlp") == "mlp"
    assert dump.module_kind("model") == "loss" and dump.module_kind("output_layer") == "output"


# ------------------------------------------------------------------ delta debugging


@pytest.mark.parametrize("guilty", [{"c"}, {"a", "f"}, {"h"}], ids=["one", "two-together", "last"])
def test_ddmin_finds_the_patches_whose_removal_fixes(guilty):
    items = list("abcdefgh")
    calls = []

    def fixed(disabled):
        calls.append(tuple(sorted(disabled)))
        return guilty <= set(disabled)

    assert set(ddmin(items, fixed)) == guilty
    # distinct replays (search() caches repeats): fewer than switching patches off one by one
    # in pairs would need
    assert len(set(calls)) < len(items) * (len(items) - 1) // 2


def test_search_widens_to_the_next_set_and_says_when_nothing_fixes():
    def replay(disabled):
        return ("z" in disabled), "detail"

    found = search([["a", "b"], ["a", "b", "z", "y"]], replay)
    assert found.culprits == ["z"]
    assert found.trials[0].disabled == ["a", "b"] and found.trials[0].fixed is False
    none = search([["a"], ["b"]], lambda d: (False, ""))
    assert none.culprits == [] and "not caused" in none.note


def test_when_nothing_fixes_the_narrowest_unreplayable_set_is_named_suspect():
    # Megatron cannot run without "fused" here; switching "check" off changes nothing
    def replay(disabled):
        return (None, "fails") if "fused" in disabled else (False, "")

    found = search([["fused"], ["check", "fused"], ["a", "b", "check", "fused"]], replay)
    assert found.culprits == [] and found.suspects == ["fused"]
    assert "suspects" in found.note
    capped = search([["a", "b", "c", "d"]], lambda d: (None, "fails"), max_trials=3)
    assert len(capped.trials) == 3 and "stopped after 3 replays" in capped.note


def test_search_looks_in_halves_when_a_set_cannot_be_switched_off_together():
    # "plumb" cannot be switched off (the replay fails): the set holding it is split
    def replay(disabled):
        if "plumb" in disabled:
            return None, "worker failed"
        return "adam" in disabled, ""

    found = search([["adam", "l2", "plumb", "scope"]], replay)
    assert found.culprits == ["adam"]
    assert found.trials[0].fixed is None
    assert len({tuple(t.disabled) for t in found.trials}) == len(found.trials)  # no repeats


# ------------------------------------------------------------------ locate.json and the report


def _locate_json(tmp_path, comp):
    data = {
        "reference": {"label": "reference", "device": "cpu", "argv": []},
        "candidate": {
            "label": "candidate",
            "device": "npu-emulated",
            "argv": [],
            "plant": "demo",
        },
        "step": {
            "step": 2,
            "quantity": "loss",
            "rel_error": 0.1,
            "threshold": 0.05,
            "approximate": {"status": "fail"},
        },
        "replayed_step": 2,
        "modules": [r.as_dict() for r in comp.rows],
        "divergent": comp.first_dict(),
        "culprit": {
            "culprits": ["norm.wrapped-torch-norm"],
            "candidate_sets": [],
            "trials": [],
            "note": "",
        },
        "reproduce": "megatron-npu locate --step 2 --out x",
    }
    return LocateResult.of(data).write(tmp_path / "loc" / FILENAME)


def test_locate_json_round_trip_and_named_errors(tmp_path):
    comp = modules.compare_dumps(
        _dump(tmp_path, "ref"), _dump(tmp_path, "bad", "norm-forward", bug_layer=1)
    )
    path = _locate_json(tmp_path, comp)
    found = LocateResult.read(path)
    assert found.divergent.module == "decoder.layers.1"
    assert found.schema_version == SCHEMA_VERSION
    assert found.to_json() == path.read_text()
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "schema_version": 99}))
    with pytest.raises(
        FormatError, match=rf"^{path}: schema_version: input should be 1 \(got 99\)"
    ):
        LocateResult.read(path)
    data["modules"][3]["forward"]["tolerance"] = "small"
    path.write_text(json.dumps(data))
    with pytest.raises(FormatError) as bad:
        LocateResult.read(path)
    assert str(bad.value).startswith(f"{path}: modules[3].forward.tolerance: ")
    assert "'small'" in str(bad.value)


def test_the_report_renders_the_module_tree_step_module_patch_and_command(tmp_path):
    from megatron_npu.reports.build import build_report

    comp = modules.compare_dumps(
        _dump(tmp_path, "ref"), _dump(tmp_path, "bad", "norm-forward", bug_layer=1)
    )
    path = _locate_json(tmp_path, comp)
    html = build_report([str(path.parent)], tmp_path / "r.html").read_text()
    assert 'id="locate"' in html
    assert 'class="locate-named"' in html and 'data-module="decoder.layers.1"' in html
    assert "norm.wrapped-torch-norm" in html
    assert "megatron-npu locate --step 2 --out x" in html
    # one heat cell per phase and module; the named one is marked
    assert html.count('class="heat"') == 3 * len(comp.rows)
    assert "error 0.00e+00" in html  # an agreeing module's cell shows its error
    # msprobe's metrics of the named module's worst tensor, beside the rule's verdict
    measured = comp.first_dict()["msprobe"]
    assert 'class="locate-msprobe-metrics"' in html and measured["data_name"] in html
    assert f"cosine {measured['cosine']:.4g}" in html


def test_the_report_renders_a_locate_msprobe_result(tmp_path):
    """``locate --msprobe``'s result as the page shows it: the named row with msprobe's metrics
    and the patches it reaches, and every compared row in dump order, the named one marked."""
    from megatron_npu.reports import locate_view
    from megatron_npu.reports.build import build_report
    from megatron_npu.reports.inputs import load

    from megatron_npu.locate import msprobe_dumps

    ref, bad = _dump(tmp_path, "ref"), _dump(tmp_path, "bad", "norm-forward", bug_layer=1)
    out = tmp_path / "located"
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--msprobe", str(ref), str(bad), "--out", str(out)])
    data = command.locate_msprobe(args).to_data()
    [located] = load([out]).locates
    view = locate_view.section(located, 0)
    assert view["mode"] == "msprobe" and view["divergent"] == data["divergent"]
    assert len(view["rows"]) == len(data["rows"])
    assert [r["name"] for r in view["rows"] if r["named"]] == [data["divergent"]["name"]]
    html = build_report([str(out)], tmp_path / "r.html").read_text()
    assert 'class="locate locate-msprobe"' in html and data["divergent"]["name"] in html
    assert html.count('<td class="heat"') == len(data["rows"])
    assert 'class="locate-msprobe-metrics"' in html
    (out / msprobe_dumps.RESULT_FILE).write_text(
        json.dumps({"format": msprobe_dumps.RESULT_FORMAT})
    )
    loaded = load([out])
    assert loaded.locates == []
    [skipped] = loaded.skipped  # one named reason: the first field that does not fit
    assert skipped.source.endswith("locate-msprobe.json"), skipped
    assert skipped.reason.startswith("schema_version: field required"), skipped


# ------------------------------------------------------------------ which patches a module reaches


def test_the_tracer_attributes_patch_code_to_the_modules_on_the_stack():
    from megatron_npu.locate.trace import Tracer

    def patched_kernel(x):
        return x * 2

    def builder():
        return torch.nn.Linear(2, 2)

    tracer = Tracer({patched_kernel.__code__: ("ops.kernel",), builder.__code__: ("ops.build",)})
    with tracer.active(building=True):
        built = builder()
    with tracer.active():
        tracer.enter("outer")
        tracer.enter("outer.inner")
        patched_kernel(1)
        tracer.leave("outer.inner")
        tracer.leave("outer")
    assert tracer.reached("outer.inner") == {"own": ["ops.kernel"], "total": ["ops.kernel"]}
    assert tracer.reached("outer") == {"own": [], "total": ["ops.kernel"]}
    assert tracer.reached("lin", built) == {"own": ["ops.build"], "total": ["ops.build"]}


def test_wrappers_sharing_one_code_count_for_the_patch_whose_original_they_wrap():
    """Wrap patches made by one factory (the ``matmul.*`` wrappers) share a code object: a call
    reaches only the patch whose closed-over original it runs."""
    from megatron_npu.locate.trace import Tracer

    def wrap(original):
        def wrapper(*args):
            return original(*args)

        return wrapper

    mm, bmm = wrap(torch.mm), wrap(torch.bmm)
    tracer = Tracer(
        {mm.__code__: ("matmul.mm", "matmul.bmm")},
        classes={},
        closures={
            "matmul.mm": {"original": id(torch.mm)},
            "matmul.bmm": {"original": id(torch.bmm)},
        },
    )
    with tracer.active():
        tracer.enter("attention")
        bmm(torch.ones(1, 2, 2), torch.ones(1, 2, 2))
        tracer.leave("attention")
    assert tracer.reached("attention")["own"] == ["matmul.bmm"]


def test_a_method_shared_with_a_class_patch_counts_only_for_its_instances():
    """The adaptor's local norm is the base of the TE norm class a TE patch installs: a local
    norm running the shared ``forward`` reaches the patch that built it, not the TE patch."""
    from megatron_npu.locate.trace import Tracer

    class Base(torch.nn.Module):
        def forward(self, x):
            return x

    class Installed(Base):
        pass

    def helper(x):
        return x

    tracer = Tracer(
        {Base.forward.__code__: ("te.norm",), helper.__code__: ("te.norm", "local.norm")},
        classes={"te.norm": Installed},
    )
    with tracer.active():
        for name, module in (("local", Base()), ("te", Installed())):
            tracer.enter(name)
            module(1)
            helper(1)  # no self: every patch whose code it is
            tracer.leave(name)
    assert tracer.reached("local")["own"] == ["local.norm", "te.norm"]
    tracer_local = Tracer({Base.forward.__code__: ("te.norm",)}, classes={"te.norm": Installed})
    with tracer_local.active():
        tracer_local.enter("local")
        Base()(1)
        tracer_local.leave("local")
    assert tracer_local.reached("local")["own"] == []
    assert tracer.reached("te")["own"] == ["local.norm", "te.norm"]


def test_patch_code_objects_cover_the_applied_patches():
    import megatron_npu
    from megatron_npu.locate.trace import patch_code_objects

    megatron_npu.apply("cpu")
    try:
        ids = {pid for pids in patch_code_objects().values() for pid in pids}
    finally:
        megatron_npu.restore()
    assert {"norm.wrapped-torch-norm", "optimizer.adam", "cross-entropy.vocab-parallel"} <= ids
    # the factory routing installs a namespace whose optim.AdamW is the adaptor's AdamW: its
    # step's code counts for both patches
    from megatron_npu.optim.adamw import FusedAdamW

    megatron_npu.apply("cpu")
    try:
        owners = patch_code_objects()[FusedAdamW.step.__code__]
    finally:
        megatron_npu.restore()
    assert {"optimizer.adam", "optimizer.factory-torch-adamw"} <= set(owners)


# ------------------------------------------------------------------ the command line


#: a whole train command line's model, data and schedule (train's parser requires them)
_MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --mock-data "
    "--micro-batch-size 2 --lr 1e-3 --train-iters 2"
).split()


#: _MODEL as train's parser gives it back: in the parser's order, numbers as Python writes them
_MODEL_GIVEN_BACK = [
    *_MODEL[:8],
    *("--micro-batch-size", "2", "--train-iters", "2", "--lr", "0.001", "--mock-data"),
]


def test_a_side_takes_the_layout_and_switches_and_drops_what_locate_sets():
    from megatron_npu.locate.command import train_side

    side = train_side(
        "reference",
        [
            *_MODEL,
            "--device",
            "cpu",
            "--nproc-per-node",
            "2",
            "--metrics-out",
            "m.json",
            "--save",
            "ck",
            "--no-save-optim",
            "--disable-patch=norm.wrapped-torch-norm",
            "--tensor-model-parallel-size",
            "2",
            "--progress",
            "plain",
        ],
    )
    # train's parser reads the line; what the replays carry is in the parser's order
    assert side.argv == [
        "--device",
        "cpu",
        "--tensor-model-parallel-size",
        "2",
        *_MODEL_GIVEN_BACK,
    ]
    assert (side.world, side.disable, side.device, side.train_iters) == (
        2,
        ["norm.wrapped-torch-norm"],
        "cpu",
        2,
    )


def test_a_compare_run_gives_its_train_options_and_metrics(tmp_path):
    from megatron_npu.locate.command import LocateError, side_from_compare

    run = tmp_path / "runs" / "npu-fp32"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text('{"steps": []}')
    (run / "run.json").write_text(
        json.dumps(
            {
                "command": [
                    "python",
                    "-m",
                    "megatron_npu.cli",
                    "train",
                    *_MODEL,
                    "--device",
                    "npu-emulated",
                    "--metrics-out",
                    str(run / "metrics.json"),
                    "--progress",
                    "plain",
                ]
            }
        )
    )
    side, metrics = side_from_compare(tmp_path, "npu-fp32")
    assert side.argv == [
        "--device",
        "npu-emulated",
        *_MODEL_GIVEN_BACK,
    ]
    assert side.device == "npu-emulated" and metrics == run / "metrics.json"
    with pytest.raises(LocateError, match="no finished compare run named 'ref'"):
        side_from_compare(tmp_path, "ref")


def test_bad_input_is_one_named_line_and_exit_2(tmp_path, capsys):
    from megatron_npu.cli import main

    model = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --mock-data"
    common = f"{model} --micro-batch-size 2 --lr 1e-3 --train-iters 2"

    def located(reference: str) -> tuple[int, list[str]]:
        argv = ["locate", f"--reference={reference}", "--candidate", "--device cpu"]
        code = main([*argv, "--common", common, "--out", str(tmp_path)])
        return code, capsys.readouterr().err.strip().splitlines()

    assert located("--bf16") == (2, ["megatron-npu locate: --reference options must name --device"])
    # train's own parser and checks judge a side's options before anything runs
    assert located("--device cpu --hiden-size 64") == (
        2,
        ["megatron-npu locate: --reference options: unrecognized arguments: --hiden-size 64"],
    )
    assert located("--device cpu --num-attention-heads 5") == (  # train's own check
        2,
        [
            "megatron-npu locate: --reference options: --hidden-size must be divisible by "
            "--num-attention-heads"
        ],
    )
    code = main(["locate", "--compare-dir", str(tmp_path), "--out", str(tmp_path)])
    assert code == 2 and "needs --pair" in capsys.readouterr().err


def test_patches_nearly_every_module_reaches_are_searched_last():
    from megatron_npu.formats.locate_dump import ModuleInfo
    from megatron_npu.locate.command import _ubiquitous

    owns = {"a": ["ns:x", "rotary"], "b": ["ns:x"], "c": ["ns:x", "norm"], "d": []}
    table = {
        name: ModuleInfo(kind="other", class_name="M", depth=0, patches={"own": own})
        for name, own in owns.items()
    }
    assert _ubiquitous(table) == {"ns:x"}


def test_a_rerun_into_the_same_folder_drops_the_old_dumps_but_keeps_a_given_reference(tmp_path):
    from megatron_npu.locate.command import _clear_dumps

    for name in ("reference", "candidate", "trial-1"):
        (tmp_path / "dumps" / name).mkdir(parents=True)
    _clear_dumps(tmp_path, str(tmp_path / "dumps" / "reference"))
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == ["reference"]
    _clear_dumps(tmp_path, None)
    assert list((tmp_path / "dumps").iterdir()) == []


def test_read_curve_takes_a_megatron_lm_log_and_its_printed_digits(tmp_path):
    """A user's own Megatron-LM log stands in for a curve run; its grad norm's three printed
    decimals are rounding, not error."""
    line = (
        " [2026-11-27 04:48:54] iteration {i:8d}/       2 | consumed samples: {s:12d} | elapsed "
        "time per iteration (ms): 50.0 | learning rate: 1.000000E-03 | global batch size:     4 | "
        "lm loss: {loss} | loss scale: 1.0 | grad norm: {norm} | number of skipped iterations:   "
        "0 | number of nan iterations:   0 |\n"
    )
    # torchrun --tee prefixes every line with its rank: the log starts with "[", not JSON
    head = (
        "[rank0]: ------------------------ arguments ------------------------\n"
        "[rank0]:   num_layers ...................................... 2\n"
        "[rank0]:   seq_length ...................................... 128\n"
        "[rank0]: -------------------- end of arguments ---------------------\n"
    )
    ref, cand = tmp_path / "gpu.log", tmp_path / "npu.log"
    ref.write_text(
        head
        + line.format(i=1, s=4, loss="7.060161E+00", norm="0.543")
        + line.format(i=2, s=8, loss="7.033757E+00", norm="0.527")
    )
    cand.write_text(
        head
        + line.format(i=1, s=4, loss="7.060161E+00", norm="0.544")
        + line.format(i=2, s=8, loss="7.033757E+00", norm="0.527")
    )
    curve = curves.read_curve(ref)
    assert (curve.iterations, curve.losses, curve.grad_norms) == (
        [1, 2],
        [7.060161, 7.033757],
        [0.543, 0.527],
    )
    assert curves.printed_resolution(ref) == {"grad_norm": 5e-4}
    assert curves.printed_resolution(tmp_path / "x.json") == {}
    resolution = curves.printed_resolution(ref)
    # one unit in the last printed digit is within both values' rounding
    assert (
        curves.first_divergent_step(curve, curves.read_curve(cand), resolution=resolution).step
        is None
    )
    # without it, 0.543 vs 0.544 (0.18 %) is beyond the 1e-4 floor
    assert curves.first_divergent_step(curve, curves.read_curve(cand)).step == 1
    with pytest.raises(curves.CurveError, match="no such file"):
        curves.read_curve(tmp_path / "missing.log")


def test_script_sides_keep_the_users_arguments_and_replays_add_megatron_lms_own():
    from megatron_npu.locate import script_runs

    argv, device, world, disable = script_runs.split_options(
        [
            "--device",
            "npu",
            "--nproc-per-node=2",
            "--disable-patch",
            "softmax.fused",
            "--num-layers",
            "2",
            "--save",
            "/ckpt",
            "--save-interval=5",
            "--no-save-optim",
            "--bf16",
        ]
    )
    assert (argv, device, world, disable) == (
        ["--num-layers", "2", "--bf16"],
        "npu",
        2,
        ["softmax.fused"],
    )
    with pytest.raises(ValueError, match="--device needs a value"):
        script_runs.split_options(["--bf16", "--device"])
    base = {"script_args": ["--train-iters", "10"], "stop": 7, "hook_step": 7}
    assert script_runs.replay_arguments({**base, "save_before": "/d/ckpt"}) == [
        [
            "--train-iters",
            "10",
            "--save",
            "/d/ckpt",
            "--save-interval",
            "6",
            "--exit-interval",
            "6",
        ],
        ["--train-iters", "10", "--load", "/d/ckpt", "--exit-interval", "7"],
    ]
    assert script_runs.replay_arguments({**base, "load": "/d/ckpt"}) == [
        ["--train-iters", "10", "--load", "/d/ckpt", "--exit-interval", "7"],
    ]
    curve = {"script_args": ["--train-iters", "10"], "stop": 10, "hook_step": 1, "curve": "c.json"}
    assert script_runs.replay_arguments(curve) == [["--train-iters", "10"]]


def test_script_side_errors_are_named(tmp_path):
    with pytest.raises(command.LocateError, match="--script: no script"):
        command.script_side("reference", "--device cpu", "", str(tmp_path / "nope.py"))
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    with pytest.raises(command.LocateError, match="--candidate options must name --device"):
        command.script_side("candidate", "--bf16", "", str(script))
    side = command.script_side(
        "reference", "--device cpu", "--nproc-per-node 2 --bf16", str(script)
    )
    assert (side.device, side.world, side.argv, side.script) == ("cpu", 2, ["--bf16"], str(script))


def test_a_rank_folder_is_an_msprobe_dump_that_msprobe_and_locate_msprobe_read(tmp_path):
    """Each rank folder of locate's dump is in msprobe's layout: its rows carry every recorded
    tensor (forward inputs and outputs, the backward's gradients, parameter gradients) under
    msprobe's names, the files load to the tensors locate compares, construct.json holds the
    module tree, and ``locate --msprobe`` on two locate dumps names the module ``compare_dumps``
    names."""
    from megatron_npu.locate import msprobe_dumps

    ref, bad = _dump(tmp_path, "ref"), _dump(tmp_path, "bad", "norm-forward", bug_layer=1)
    index, tensors = dump.read_rank(bad, 0)
    msprobe = json.loads((bad / "rank0" / "dump.json").read_text())
    assert (msprobe["task"], msprobe["level"], msprobe["framework"]) == ("tensor", "L0", "pytorch")
    rows = msprobe["data"]
    files = {
        t["data_name"]
        for row in rows.values()
        for slot in row.values()
        for t in (
            slot
            if isinstance(slot, list)
            else [x for v in slot.values() for x in v]
            if isinstance(slot, dict)
            else []
        )
    }
    placed = {e.data_name for e in index.entries if e.module != dump.OPTIMIZER}
    assert files == placed and len(files) == len(placed)
    for entry in index.entries:
        stored = torch.load(bad / "rank0" / dump.TENSOR_DIR / entry.data_name, weights_only=True)
        assert torch.equal(stored, tensors[entry.key])
    layer = "Module.decoder.layers.1.Block"
    assert {f"{layer}.forward.0", f"{layer}.backward.0"} <= rows.keys()
    assert rows[f"{layer}.forward.0"]["output"][0]["data_name"] == f"{layer}.forward.0.output.0.pt"
    grads = [name for name in rows if name.endswith(".parameters_grad.0")]
    assert grads and all(isinstance(rows[name], dict) for name in grads)
    construct = json.loads((bad / "rank0" / "construct.json").read_text())
    assert construct[f"{layer}.forward.0"].startswith("Module.model.")
    found = msprobe_dumps.compare(
        msprobe_dumps.read_dump(ref), msprobe_dumps.read_dump(bad), modules.rule_for("float32")
    )
    assert found["divergent"]["name"] == f"{layer}.forward.0"


def test_ttraces_gradient_bound_as_megatron_states_it():
    """The bound Megatron's checkpoint-consistency test applies: 4 * 1.03**33 * 2**-7 = 8.29 %
    for a 32-layer bf16 model at l = 0 (its gate's choice), tighter for later layers."""
    from megatron_npu.locate import gradient_bound

    assert gradient_bound.bound("bfloat16", 0, 32) == pytest.approx(0.08288547619861457)
    assert gradient_bound.bound("float32", 33, 32) == pytest.approx(4 * 2.0**-23)
    assert gradient_bound.bound("float16", 5, 32) < gradient_bound.bound("float16", 4, 32)
    verdict = gradient_bound.judge(
        [("w", 1, 0.5), ("b", 1, math.inf), ("c", 2, 0.0)], 2, "bfloat16"
    )
    assert verdict["caught"] and [e["parameter"] for e in verdict["exceeding"]] == ["w", "b"]


def test_the_gradient_bound_on_a_located_step(tmp_path):
    """On the same dumps: a healthy pair leaves every gradient within TTrace's bound, a planted
    forward bug in layer 1 puts gradients beyond it, the embedding's included."""
    ref = _dump(tmp_path, "ref")
    healthy = modules.compare_dumps(ref, _dump(tmp_path, "same")).gradient_bound("float32")
    assert not healthy["caught"] and healthy["parameters"] == 16 and healthy["num_layers"] == 3
    planted = modules.compare_dumps(ref, _dump(tmp_path, "bad", "norm-forward", bug_layer=1))
    verdict = planted.gradient_bound("float32")
    assert verdict["caught"]
    assert {e["parameter"].split(".")[0] for e in verdict["exceeding"]} >= {"embedding"}
    assert all(e["error"] > e["bound"] for e in verdict["exceeding"])
