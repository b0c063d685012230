"""Matrix files: typed loading, clear errors, vocabulary alignment, the shipped default."""

from __future__ import annotations

import pytest

from megatron_npu.compare import matrix as m

from .minimal_matrix import DEFAULTS, TRAIN_DEFAULTS


def write(tmp_path, text):
    path = tmp_path / "m.toml"
    path.write_text(text)
    return path


BASE = (
    DEFAULTS
    + """[[run]]
name = "a"
device = "cpu"
"""
)


@pytest.mark.parametrize(
    "extra,needle",
    [
        ('[[run]]\nname = "b"\ndevice = "tpu"\n', "unknown device(s) ['tpu']"),
        (
            '[[run]]\nname = "b"\noptions = { metrics-out = "x" }\n',
            "option 'metrics-out' is set by compare",
        ),
        ('[[run]]\nname = "b"\nrerun_of = "zz"\n', "rerun_of 'zz' must name an earlier run"),
        ('[[run]]\nname = "a"\n', "the name is used twice"),
        ('[[run]]\nname = "b"\nreference = "nope"\n', "reference 'nope' is not a run"),
        ('[[run]]\nname = "b"\ncolour = 1\n', "unknown key(s) ['colour']"),
        ('[compare]\nrtol = "five"\n', "rtol must be float"),
        ('[compare]\nvary = ["sed"]\n', "unknown fingerprint field(s) ['sed']"),
        ('[compare]\nbaseline = "zz"\n', "baseline 'zz' is not one of the runs"),
        ('[[run]]\nname = "b"\ntimeout_s = -1\n', "timeout_s must be a positive number"),
        ('[[run]]\nname = "b"\nperturb = "init-ulp"\n', "perturb needs rerun_of"),
        ('[[run]]\nname = "b"\nrerun_of = "a"\nperturb = "ulp"\n', "perturb must be one of"),
        (
            '[[run]]\nname = "b"\nrerun_of = "a"\nperturb = "seed"\nreference = "a"\n',
            "a perturbed rerun measures its run's noise; it takes no reference",
        ),
        (
            '[[run]]\nname = "g"\nimport = "x.log"\n[[run]]\nname = "b"\nrerun_of = "g"\n'
            'perturb = "init-ulp"\n',
            "rerun_of 'g' names an imported run, which was not run here and cannot be rerun",
        ),
        (
            '[[run]]\nname = "s"\nscript = "p.py"\nargs = ["--load", "ck"]\n'
            '[[run]]\nname = "b"\nrerun_of = "s"\nperturb = "init-ulp-down"\n',
            "perturb = 'init-ulp-down' moves the initial weights, and the script's --load",
        ),
        (
            '[[run]]\nname = "s"\nscript = "p.py"\nargs = ["--seed", "x"]\n'
            '[[run]]\nname = "b"\nrerun_of = "s"\nperturb = "seed"\n',
            "the script's --seed 'x' is not an integer",
        ),
        (
            '[[run]]\nname = "s"\nscript = "p.py"\nargs = ["--lr", "1", "--seed"]\n'
            '[[run]]\nname = "b"\nrerun_of = "s"\nperturb = "seed"\n',
            "the script's --seed has no value",
        ),
        (
            '[[run]]\nname = "s"\nscript = "p.py"\nargs = ["--pretrained-checkpoint=ck"]\n'
            '[[run]]\nname = "b"\nrerun_of = "s"\nperturb = "init-ulp"\n',
            "the script's --pretrained-checkpoint replaces them with a checkpoint's",
        ),
        (
            '[[run]]\nname = "b"\nrerun_of = "a"\nperturb = "threads"\n'
            '[[run]]\nname = "c"\nrerun_of = "b"\n',
            "rerun_of 'b' names a perturbed rerun: rerun its original, 'a'",
        ),
        # a rerun of a script that saves would resume from, and write over, its original's
        (
            '[[run]]\nname = "s"\nscript = "p.py"\nargs = ["--save", "ck", "--load", "ck"]\n'
            '[[run]]\nname = "b"\nrerun_of = "s"\nperturb = "seed"\n',
            "run 'b' saves to",
        ),
        (
            '[[run]]\nname = "s"\nscript = "p.py"\nargs = ["--save=ck"]\n'
            '[[run]]\nname = "t"\nscript = "p.py"\nargs = ["--load", "ck"]\n',
            "run 't' loads from",
        ),
        (
            '[[run]]\nname = "b"\noptions = { num-layerz = 3 }\n',
            "run 'b': its train options: unrecognized arguments: --num-layerz 3",
        ),
        (
            '[[run]]\nname = "b"\noptions = { tensor-model-parallel-size = 2 }\n',
            "run 'b': its train options: world size 1 is not divisible by",
        ),
        (
            '[[run]]\nname = "b"\noptions = { lr = "fast" }\n',
            "run 'b': its train options: argument --lr: must be a number, got 'fast'",
        ),
    ],
)
def test_bad_matrices_are_named(tmp_path, extra, needle):
    with pytest.raises(m.MatrixError) as info:
        m.load(write(tmp_path, BASE + extra))
    assert needle in str(info.value)


def test_unreadable_and_invalid_toml(tmp_path):
    with pytest.raises(m.MatrixError, match="cannot read matrix"):
        m.load(tmp_path / "missing.toml")
    with pytest.raises(m.MatrixError, match="not valid TOML"):
        m.load(write(tmp_path, "[[run]\nname="))


def test_runs_are_typed_and_reruns_copy_their_original(tmp_path):
    matrix = m.load(
        write(
            tmp_path,
            BASE
            + (
                '[[run]]\nname = "b"\ndevice = ["npu", "npu-emulated"]\n'
                "options = { bf16 = true, lr = 2e-3 }\n"
            )
            + '[[run]]\nname = "a2"\nrerun_of = "a"\n',
        )
    )
    a, b, a2 = matrix.runs
    assert matrix.settings.baseline == "a" and a.reference is None
    assert b.devices == ("npu", "npu-emulated") and b.reference == "a"
    assert m.option_argv(
        {k: v for k, v in b.options.items() if k != "make-vocab-size-divisible-by"}
    ) == [*m.option_argv({**TRAIN_DEFAULTS, "lr": 2e-3}), "--bf16"]
    assert (
        a2.options == a.options
        and a2.devices == a.devices
        and a2.reference == "a"
        and a2.rerun_of == "a"
    )


def test_vocab_padding_is_aligned_across_tensor_parallel_sizes(tmp_path):
    text = BASE + (
        '[[run]]\nname = "tp2"\noptions = { tensor-model-parallel-size = 2, nproc-per-node = 2 }\n'
    )
    matrix = m.load(write(tmp_path, text))
    by_name = {r.name: r for r in matrix.runs}
    # Megatron pads to divisible-by x TP: 256 x 1 == 128 x 2
    assert by_name["a"].options["make-vocab-size-divisible-by"] * 1 == 256
    assert by_name["tp2"].options.get("make-vocab-size-divisible-by", 128) * 2 == 256
    assert any("multiple of 256" in note for note in matrix.notes)
    unaligned = m.load(write(tmp_path, "[compare]\nalign_vocab = false\n" + text))
    assert all("make-vocab-size-divisible-by" not in r.options for r in unaligned.runs)


def test_the_default_matrix_has_the_rows_the_issue_asks_for():
    matrix = m.load(None)
    runs = {r.name: r for r in matrix.runs}
    assert matrix.source == "default" and matrix.settings.baseline == "ref-fp32"
    assert runs["ref-fp32"].devices == ("cpu",)
    npu_rows = [r for r in matrix.runs if r.devices == ("npu", "npu-emulated")]
    assert {r.option("bf16", False) for r in npu_rows} == {False, True}
    assert any(r.tensor_parallel == 2 for r in npu_rows)
    assert any(r.option("pipeline-model-parallel-size") == 2 for r in npu_rows)
    assert any(r.option("use-flash-attn") and r.option("pre-tokens") == 65536 for r in npu_rows)
    sparse = [r for r in npu_rows if r.option("pre-tokens", 65536) < 65536]
    assert sparse and all(r.option("pre-tokens") < r.option("seq-length") for r in sparse)
    assert any(r.rerun_of == "ref-fp32" for r in matrix.runs)
    te = {r.name: r for r in matrix.runs if r.option("transformer-impl") == "transformer_engine"}
    assert te["ref-fp32-te"].devices == ("cpu",)
    assert te["npu-fp32-te"].reference == "ref-fp32-te"
    assert te["npu-fp32-te-tp2"].tensor_parallel == 2
    assert te["npu-fp32-te-tp2"].reference == "npu-fp32-te"
    assert te["npu-fp32-te-cp2"].option("context-parallel-size") == 2
    assert te["npu-fp32-te-cp2"].reference == "npu-fp32-te"
    cuda = [r for r in matrix.runs if "cuda" in r.devices]
    assert cuda and all(r.optional for r in cuda)


def test_reference_rows_are_not_judged(tmp_path):
    matrix = m.load(
        write(
            tmp_path,
            BASE + '[[run]]\nname = "w"\nreference = false\n[[run]]\nname = "x"\nreference = "w"\n',
        )
    )
    a, w, x = matrix.runs
    assert not a.judged and not w.judged and w.reference is None
    assert x.judged and x.reference == "w"
    with pytest.raises(m.MatrixError, match="reference must be a run name or false"):
        m.load(write(tmp_path, BASE + '[[run]]\nname = "w"\nreference = 3\n'))


def test_perturbed_reruns_copy_their_original_and_are_not_judged(tmp_path):
    text = BASE + "".join(
        f'[[run]]\nname = "{p}"\nrerun_of = "a"\nperturb = "{p}"\n'
        for p in ("init-ulp", "init-ulp-down", "threads", "seed")
    )
    runs = {r.name: r for r in m.load(write(tmp_path, text)).runs}
    assert runs["init-ulp"].options == {**runs["a"].options, "init-ulp-nudge": 1}
    assert runs["init-ulp-down"].options["init-ulp-nudge"] == -1
    assert runs["threads"].options == runs["a"].options
    assert runs["seed"].options["seed"] == 1235
    for name in ("init-ulp", "init-ulp-down", "threads", "seed"):
        assert runs[name].perturb == name and runs[name].rerun_of == "a"
        assert not runs[name].judged and runs[name].reference is None


@pytest.mark.parametrize(
    "args, seeded",
    [
        (["--lr", "1e-3", "--seed", "7"], ("--lr", "1e-3", "--seed", "8")),
        (["--seed=7", "--lr", "1e-3"], ("--seed=8", "--lr", "1e-3")),
        (["--lr", "1e-3"], ("--lr", "1e-3", "--seed", "1235")),  # Megatron-LM's 1234, next
        # argparse keeps the last one
        (["--seed", "1", "--seed", "5"], ("--seed", "1", "--seed", "6")),
    ],
)
def test_reruns_of_a_script_run_are_script_runs_of_the_same_arguments(tmp_path, args, seeded):
    """A plain rerun and each perturbed rerun of a script run run the same script on as many
    ranks; only ``seed`` changes its arguments (the next seed); the rounding perturbations
    change its environment (the runner's)."""
    quoted = ", ".join(f'"{a}"' for a in args)
    text = (
        f'[compare]\nbaseline = "s"\n[[run]]\nname = "s"\nscript = "p.py"\nargs = [{quoted}]\n'
        'nproc_per_node = 2\ndevice = "npu-emulated"\n'
        '[[run]]\nname = "again"\nrerun_of = "s"\n'
        + "".join(
            f'[[run]]\nname = "{p}"\nrerun_of = "s"\nperturb = "{p}"\n'
            for p in ("init-ulp", "init-ulp-down", "threads", "seed")
        )
    )
    runs = {r.name: r for r in m.load(write(tmp_path, text)).runs}
    for name in ("again", "init-ulp", "init-ulp-down", "threads", "seed"):
        run = runs[name]
        assert (run.kind, run.path, run.nproc_per_node, run.devices) == (
            "script",
            str(tmp_path / "p.py"),
            2,
            ("npu-emulated",),
        ), name
        assert run.script_args == (seeded if name == "seed" else tuple(args)), name
    assert runs["again"].judged and runs["again"].reference == "s"
    assert not runs["threads"].judged and runs["threads"].reference is None
