"""Tokenizers: round trips, exact BPE / WordPiece splits, and the megatron-core interface."""

from __future__ import annotations

import json
import random

import pytest

from megatron_npu.data.tokenizers import (
    BertWordPieceTokenizer,
    ByteLevelTokenizer,
    GPT2BPETokenizer,
    MegatronTokenizerBase,
    TokenizerError,
    bert_basic_tokenize,
    build_tokenizer,
    bytes_to_unicode,
    gpt2_pretokenize,
)

from ._util import BERT_VOCAB, write_bert_vocab, write_tiny_gpt2_files

SAMPLES = [
    "",
    "Hello, world!",
    "  two  spaces\tand tabs\n\nnew paragraphs  \n",
    "naïve café — déjà vu ½ Ⅻ ٣٤ 中文字符 日本語 😀👍🏽",
    "control \x00\x01\x7f chars and \u200b zero width",
    "don't you'll I'm we've they're she'd it's",
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcXYZ 0123456789 \t\n'.,!?-_éü中文😀\u00a0\u2028"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(n)]


# -- byte level ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES + _random_texts(20))
def test_byte_level_round_trip_is_exact(text):
    tok = ByteLevelTokenizer()
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids) == text
    assert tok.detokenize(ids + [tok.eod]) == text


def test_byte_level_specials():
    tok = ByteLevelTokenizer()
    assert (tok.eod, tok.vocab_size, len(tok.vocab)) == (256, 257, 257)
    with pytest.raises(NotImplementedError):
        tok.pad  # noqa: B018 - no pad token: GPTDataset falls back to its -1 pad id


# -- GPT-2 BPE -------------------------------------------------------------------------------------


def test_bytes_to_unicode_is_a_bijection_onto_printables():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"


@pytest.mark.parametrize(
    "text, pieces",
    [
        ("Hello world's 123 !!  \n", ["Hello", " world", "'s", " 123", " !!", "  \n"]),
        ("a  b", ["a", " ", " b"]),
        ("I'll go, don't!", ["I", "'ll", " go", ",", " don", "'t", "!"]),
        ("x\t\ty", ["x", "\t", "\t", "y"]),
        ("héllo 中文 ٣٤ ½ Ⅻ foo_bar", ["héllo", " 中文", " ٣٤", " ½", " Ⅻ", " foo", "_", "bar"]),
        ("abc123def", ["abc", "123", "def"]),
        ("  end  ", [" ", " end", "  "]),
    ],
)
def test_gpt2_pretokenizer_matches_reference_splits(text, pieces):
    assert gpt2_pretokenize(text) == pieces
    assert "".join(gpt2_pretokenize(text)) == text


def test_gpt2_bpe_exact_merges(tmp_path):
    vocab_path, merges_path, vocab = write_tiny_gpt2_files(tmp_path)
    tok = GPT2BPETokenizer(vocab_path, merges_path)
    assert tok.vocab_size == len(vocab) and tok.eod == vocab["<|endoftext|>"]
    ids = tok.tokenize("the theme is this")
    pieces = [tok.inv_vocab[i] for i in ids]
    # merges apply lowest rank first: " this" -> Ġt h i s -> Ġt h is (no "Ġt h" merge)
    assert pieces == ["the", "Ġthe", "m", "e", "Ġis", "Ġt", "h", "is"]
    assert tok.detokenize(ids) == "the theme is this"


@pytest.mark.parametrize("text", SAMPLES + _random_texts(30, seed=1))
def test_gpt2_bpe_round_trip(tmp_path, text):
    vocab_path, merges_path, _ = write_tiny_gpt2_files(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_path, merges_path)
    ids = tok.tokenize(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.detokenize(ids) == text


def test_gpt2_bpe_bad_files(tmp_path):
    vocab_path, merges_path, vocab = write_tiny_gpt2_files(tmp_path)
    with pytest.raises(TokenizerError, match="vocab.json"):
        GPT2BPETokenizer(tmp_path / "missing" / "vocab.json", merges_path)
    del vocab["<|endoftext|>"]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(TokenizerError, match="endoftext"):
        GPT2BPETokenizer(vocab_path, merges_path)
    with pytest.raises(TokenizerError, match="merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_path)


# -- BERT WordPiece --------------------------------------------------------------------------------


def test_bert_basic_tokenizer():
    assert bert_basic_tokenize("Héllo, WORLD! 中文 un-affable\x00\u200b") == [
        "hello",
        ",",
        "world",
        "!",
        "中",
        "文",
        "un",
        "-",
        "affable",
    ]
    assert bert_basic_tokenize("Héllo,  World", lower_case=False) == ["Héllo", ",", "World"]


def test_wordpiece_lower_case(tmp_path):
    tok = build_tokenizer("BertWordPieceLowerCase", write_bert_vocab(tmp_path))
    assert isinstance(tok, BertWordPieceTokenizer)
    text = "Hello, unaffable WORLD! Playing plays xyzzy 中文 Café."
    tokens = tok.text_to_tokens(text)
    assert tokens == [
        "hello",
        ",",
        "un",
        "##aff",
        "##able",
        "world",
        "!",
        "play",
        "##ing",
        "play",
        "##s",
        "[UNK]",
        "中",
        "文",
        "cafe",
        ".",
    ]
    ids = tok.tokenize(text)
    assert ids == [BERT_VOCAB.index(t) for t in tokens]
    assert tok.detokenize(ids) == "hello , unaffable world ! playing plays [UNK] 中 文 cafe ."
    # a word whose tail has no "##" piece is [UNK] as a whole (greedy longest match first)
    assert tok.text_to_tokens("unaffablex") == ["[UNK]"]
    assert tok.text_to_tokens("a" * 101) == ["[UNK]"]
    assert (tok.eod, tok.sep, tok.pad, tok.cls, tok.mask) == (3, 3, 0, 2, 4)
    assert tok.vocab_size == len(BERT_VOCAB)


def test_wordpiece_cased(tmp_path):
    tok = build_tokenizer("BertWordPieceCase", write_bert_vocab(tmp_path))
    assert tok.text_to_tokens("Hello hello WORLD") == ["Hello", "hello", "[UNK]"]


def test_wordpiece_needs_special_tokens(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("hello\nworld\n")
    with pytest.raises(TokenizerError, match=r"\[UNK\]"):
        BertWordPieceTokenizer(path)


# -- megatron-core interface -----------------------------------------------------------------------


def _all_tokenizers(tmp_path):
    vocab_path, merges_path, _ = write_tiny_gpt2_files(tmp_path)
    return [
        build_tokenizer("ByteLevel"),
        build_tokenizer("GPT2BPETokenizer", vocab_path, merges_path),
        build_tokenizer("BertWordPieceLowerCase", write_bert_vocab(tmp_path)),
    ]


def test_tokenizers_satisfy_megatron_dataset_config(tmp_path):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    again = _all_tokenizers(tmp_path)
    for tok, same in zip(_all_tokenizers(tmp_path), again, strict=True):
        assert isinstance(tok, MegatronTokenizerBase)
        assert isinstance(tok.eod, int) and 0 <= tok.eod < tok.vocab_size
        # serialisable and stable: megatron hashes it into the dataset cache key
        described = json.dumps(tok.unique_identifiers)
        assert described == json.dumps(same.unique_identifiers)
        assert type(tok).__name__ in described
        config = GPTDatasetConfig(
            random_seed=1,
            sequence_length=8,
            tokenizer=tok,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        )
        assert config.token_dtype_code == 8  # uint16 ids for every vocab here


def test_unique_identifiers_distinguish_tokenizers(tmp_path):
    descriptions = {json.dumps(t.unique_identifiers) for t in _all_tokenizers(tmp_path)}
    descriptions.add(
        json.dumps(build_tokenizer("BertWordPieceCase", tmp_path / "vocab.txt").unique_identifiers)
    )
    assert len(descriptions) == 4


def test_build_tokenizer_rejects_unknown_type():
    with pytest.raises(TokenizerError, match="unknown tokenizer type"):
        build_tokenizer("SentencePieceTokenizer")
