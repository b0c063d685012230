"""Stand-in for Megatron-LM's ``megatron/training/tokenizer/tokenizer.py`` (``_NullTokenizer``).

The user guide runs its loop inside a Megatron-LM checkout (``PYTHONPATH=./megatron``), where this
module exists; the megatron-core wheel does not ship ``megatron.training``. The seed-example test
puts this directory on ``PYTHONPATH`` in its place (``megatron`` is a namespace package, so it
merges with the installed ``megatron.core``). Behaviour as Megatron-LM's: ids are the integers
themselves, the end-of-document id is ``vocab_size`` and the vocabulary holds it too; there is
no pad token (the dataset falls back to its own).
"""

from collections import OrderedDict


class _NullTokenizer:
    def __init__(self, vocab_size):
        self._vocab_size_without_eod = int(vocab_size)
        self._eod_id = self._vocab_size_without_eod

    def tokenize(self, text):
        return [int(x) for x in text.split(" ")]

    def detokenize(self, ids):
        return " ".join(str(x) for x in ids)

    @property
    def unique_identifiers(self):
        return OrderedDict({"class": f"{type(self).__module__}.{type(self).__qualname__}"})

    @property
    def vocab_size(self):
        return self._vocab_size_without_eod + 1

    @property
    def eod(self):
        return self._eod_id
