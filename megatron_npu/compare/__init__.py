"""``megatron-npu compare``: end-to-end comparisons of training runs across devices and layouts.

One module per job: :mod:`.matrix` (the TOML matrix -> dataclasses), :mod:`.runner` (one run as
a ``megatron-npu train`` subprocess, cached by config hash), :mod:`.fingerprint` (what must match),
:mod:`.rules` (the verdict rules), :mod:`.table2` (Table 2 of Ascend's Megatron-LM adaptation
guide), :mod:`.results` (the results JSON, docs/compare-results.md) and :mod:`.command` (the command
that ties them).
"""
