"""``megatron-npu locate``: the first divergent step, module and patch between two runs.

One module per job (docs/locate.md has the whole method; the file formats are
:mod:`megatron_npu.formats.locate_result` and :mod:`megatron_npu.formats.locate_dump`):

* :mod:`.curves` -- the two runs' loss / grad-norm curves -> the first divergent step
* :mod:`.trace` -- which adaptor patches each module reaches (built it, or ran inside it)
* :mod:`.dump` -- hooks on every module of one rank; the dump folder (``.pt`` + JSON index)
* :mod:`.worker` -- one run of one configuration in its own process(es): train, save, replay
* :mod:`.modules` -- module-by-module comparison of two dumps (``megatron_npu.parity.metrics``) and
  the input-explained error rule
* :mod:`.culprit` -- delta debugging over the patches the divergent module reaches
* :mod:`.command` -- the command line and the whole search
"""
