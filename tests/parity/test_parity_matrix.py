"""The parity matrix in CI (``--parity-mode quick`` by default); see parity/cells_test.py."""

from megatron_npu.parity.cells_test import pytest_generate_tests, test_parity  # noqa: F401
