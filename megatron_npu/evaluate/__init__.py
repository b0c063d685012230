"""``megatron-npu evaluate``: zero-shot evaluation of a checkpoint (LAMBADA cloze).

:mod:`.lambada` reads the data and builds samples (Megatron-LM's ``tasks/zeroshot_gpt`` rules),
:mod:`.cloze_set` builds the shipped default set from the embedded corpus, :mod:`.command` loads a
checkpoint in any TP/PP layout and scores it.
"""
