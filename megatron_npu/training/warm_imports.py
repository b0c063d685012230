"""What every rank imports, imported once by :func:`.launch.run_warm`'s fork server (its ranks
fork from it): Megatron's expected import-time notes are silenced first, as a rank's own entry
point silences them, so the fork server prints nothing either."""

from megatron_npu.training import quiet_expected_warnings

quiet_expected_warnings()

import torch  # noqa: E402,F401
from megatron.core import parallel_state  # noqa: E402,F401

from megatron_npu.training import loop  # noqa: E402,F401
