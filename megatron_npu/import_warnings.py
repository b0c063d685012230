"""megatron-core's import-time notices that do not apply under the adaptor.

Importing megatron-core without NVIDIA Transformer Engine or apex warns, once per module, that it
falls back to its local implementations ("Transformer Engine and Apex are not installed ...").
On an NPU or CPU that fallback is the intended path, and the adaptor's patches serve the fused
ones, so every command would otherwise open with four misleading warnings. They are filtered out
when ``megatron_npu`` is imported, unless the user asked for warnings themselves
(``python -W ...`` or ``PYTHONWARNINGS``, which Python records in ``sys.warnoptions``).
"""

from __future__ import annotations

import sys
import warnings

#: the messages (regular expressions, matched at the start) megatron-core warns with on import
MESSAGES = (
    r".*Transformer Engine and Apex are not installed",
    r"Apex is not installed",
)


def quiet() -> None:
    """Filter out :data:`MESSAGES` unless warnings were configured on the command line."""
    if sys.warnoptions:
        return
    for message in MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
