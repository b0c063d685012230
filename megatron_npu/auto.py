"""``import megatron_npu.auto``: the one line that makes an unmodified Megatron-Core script run
on the device named by ``$MEGATRON_NPU_DEVICE`` (auto-detected when unset).

It is ``megatron_npu.apply(None, transfer=True)``: the registry patches plus transparent mode
(:mod:`megatron_npu.transfer`), so the script's own ``torch.cuda.*`` calls,
``torch.device("cuda")``, ``.cuda()`` / ``.to("cuda")``, ``init_process_group()`` with the ``nccl``
default and Megatron's ``compile_helpers()`` all work on ``cpu``, ``npu-emulated`` and ``npu``.
``megatron_npu.restore()`` undoes it.
"""

import megatron_npu
from megatron_npu.patches import jit_fusions

# a script process on a non-CUDA device: Megatron's @jit_fuser functions load uncompiled
jit_fusions.load_eagerly(None)
RESULTS = megatron_npu.apply(None, transfer=True)
