"""One rank of ``megatron-npu evaluate``: what the launcher starts (``python -m``)."""

from __future__ import annotations

import sys

from megatron_npu.evaluate.command import worker_main
from megatron_npu.training.launch import arm_rank

if __name__ == "__main__":
    arm_rank()  # dies with the launcher that started it
    sys.exit(worker_main(sys.argv[1:]))
