"""One rank of ``megatron-npu evaluate``: what the launcher starts (``python -m``)."""

from __future__ import annotations

import sys

from megatron_npu.evaluate.command import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
