"""LAMBADA data: the public lambada_test.jsonl format, Megatron-LM's strict / non-strict split,
sample layout, and the shipped cloze set."""

from __future__ import annotations

import json

import pytest

from megatron_npu.data.tokenizers import ByteLevelTokenizer
from megatron_npu.evaluate import cloze_set, command
from megatron_npu.evaluate import lambada as lb

# Two lines in the public file's exact shape (one JSON object per line, a "text" key).
PUBLIC = (
    '{"text": "In my palm is a clear stone , and inside it is a small ivory statuette . '
    "a guardian angel . \\\" figured if you 're going to be out at night getting hit by cars , "
    "you might as well have some "
    'extra protection . \\" the words on the card read \\" guardian \\""}\n'
    '{"text": "he was going to be late for the train if he kept dawdling , '
    'so he ran to the station"}\n'
)


def test_reads_the_public_format(tmp_path):
    path = tmp_path / "lambada_test.jsonl"
    path.write_text(PUBLIC)
    passages = lb.read_passages(path)
    assert len(passages) == 2
    assert passages[1].endswith("ran to the station")
    assert (
        passages[0].split()[-1] == '"'
    )  # the public set has such endings; strict takes the word as split


@pytest.mark.parametrize(
    "text,needle",
    [
        ("not json\n", ":1: not a JSON line"),
        ('{"txt": "a b"}\n', ':1: needs a non-empty "text"'),
        ("\n\n", "no passages"),
    ],
)
def test_bad_files_are_named(tmp_path, text, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(lb.LambadaDataError, match=needle):
        lb.read_passages(path)


def test_strict_and_non_strict_split_like_megatron():
    tok = ByteLevelTokenizer()
    text = "the cat sat on the mat"
    context, target = lb.split_passage(text, tok, strict=False)
    assert bytes(context) == b"the cat sat on the ma" and bytes(target) == b"t"
    context, target = lb.split_passage(text, tok, strict=True)
    assert bytes(context) == b"the cat sat on the" and bytes(target) == b" mat"
    # rfind: the last occurrence of the last word; the context is stripped before tokenizing
    context, target = lb.split_passage("mat on a mat ", tok, strict=True)
    assert bytes(context) == b"mat on a" and bytes(target) == b" mat"


def test_sample_layout_pads_with_eod_and_masks_the_target():
    tok = ByteLevelTokenizer()
    sample = lb.build_sample([1, 2, 3], [4, 5], seq_length=8, pad=tok.eod)
    assert sample.tokens == [1, 2, 3, 4, 5, tok.eod, tok.eod, tok.eod, tok.eod]
    # labels are tokens[1:]: 2 3 4 5 pad...; the target 4 5 sits at label positions 2 and 3
    assert sample.mask == [0, 0, 1, 1, 0, 0, 0, 0] and not sample.truncated
    long = lb.build_sample(list(range(10)), [98, 99], seq_length=5, pad=tok.eod)
    assert long.truncated and long.tokens == [6, 7, 8, 9, 98, 99] and long.mask == [0, 0, 0, 1, 1]


def test_the_shipped_cloze_set_fits_the_default_model():
    tok = ByteLevelTokenizer()
    passages = lb.read_passages("default")
    assert len(passages) == cloze_set.SIZE and len(set(passages)) == len(passages)
    for text in passages:
        assert cloze_set.MIN_CHARS <= len(text) <= cloze_set.MAX_CHARS and text.isascii()
        assert text.split()[-1].isalpha() and len(text.split()[-1]) >= 4
        for strict in (False, True):
            assert not any(s.truncated for s in lb.build_samples([text], tok, 128, strict))
    lines = lb.DEFAULT_DATA.read_text().splitlines()
    assert all(set(json.loads(line)) == {"text"} for line in lines)


def test_cloze_candidates_end_on_their_answer_word():
    documents = [
        "Return the number of items in the container object. x. Short one. "
        "Ünïcode sentences are skipped entirely here because they are not ascii.",
        "Return the number of items in the container object.",  # duplicate
    ]
    assert cloze_set.candidate_passages(documents) == [
        "Return the number of items in the container object"
    ]
    assert cloze_set.select(list("abcdefghij"), 5) == ["a", "c", "e", "g", "i"]


def test_evaluate_refuses_bad_invocations(tmp_path, capsys):
    assert (
        command.main(
            [
                "--task",
                "lambada",
                "--num-layers",
                "1",
                "--hidden-size",
                "8",
                "--num-attention-heads",
                "2",
                "--seq-length",
                "16",
            ]
        )
        == 2
    )
    assert "--load CKPT is required" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    assert (
        command.main(
            [
                "--task",
                "lambada",
                "--load",
                str(tmp_path),
                "--valid-data",
                str(bad),
                "--num-layers",
                "1",
                "--hidden-size",
                "8",
                "--num-attention-heads",
                "2",
                "--seq-length",
                "16",
            ]
        )
        == 2
    )
    assert f"{bad}:1" in capsys.readouterr().err


def test_only_a_users_file_is_called_lambada(tmp_path):
    from megatron_npu.compare import table2

    path = tmp_path / "lambada_test.jsonl"
    path.write_text(PUBLIC)
    assert lb.set_name("default") == lb.set_name(lb.DEFAULT_DATA) == lb.CORPUS_CLOZE_SET
    assert lb.set_name(path) == lb.LAMBADA_SET
    # Table 2 heads its column by the set, and hides an accuracy no run scored
    rows = [{"cloze_set": "corpus-cloze", "cloze_accuracy": 0.0, "cloze_nll": 4.5}]
    assert table2.cloze_label(rows) == "corpus cloze target NLL"
    assert table2.cell("cloze", rows[0], rows) == "4.500"
    rows.append({"cloze_set": "corpus-cloze", "cloze_accuracy": 0.02, "cloze_nll": 4.1})
    assert table2.cloze_label(rows) == "corpus cloze acc % (target NLL)"
    assert table2.cell("cloze", rows[1], rows) == "2.0 (4.100)"
    lambada = [{"cloze_set": "lambada", "cloze_accuracy": 0.0, "cloze_nll": 7.0}]
    assert table2.cloze_label(lambada) == "LAMBADA acc % (target NLL)"
    assert table2.cell("cloze", lambada[0], lambada) == "0.0 (7.000)"
