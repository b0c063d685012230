"""Run a user's own Megatron-LM script through the adaptor: the one-line wrapper as a module.

    torchrun --nproc-per-node 2 -m megatron_npu.run_script PATH/pretrain_gpt.py --its --own args

is the same as a wrapper file holding ``import megatron_npu.auto`` and then running the script as
``__main__``: the device comes from ``$MEGATRON_NPU_DEVICE`` (auto-detected when unset), the
script's folder is put first on ``sys.path`` (as ``python SCRIPT`` does, so its builder modules
import) and ``sys.argv`` is the script's own. Megatron-LM's ``megatron`` package must be
importable (``PYTHONPATH`` holding the Megatron-LM checkout), as for the script run directly.

With ``$MEGATRON_NPU_KERNEL_COUNTS=PREFIX`` on ``npu-emulated``, each rank writes how often each
emulated torch_npu kernel ran to ``PREFIX.rank<N>.json`` when the script ends: the evidence that
the script's fused paths reached the NPU kernels. With ``$MEGATRON_NPU_INIT_ULP_NUDGE=K`` every
model the script builds starts with its weights K ulps away (compare's rounding reruns of a
script run, :mod:`megatron_npu.training.weight_nudge`).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path

from megatron_npu import console
from megatron_npu.devices.facts import NPU_EMULATED

KERNEL_COUNTS_ENV = "MEGATRON_NPU_KERNEL_COUNTS"
DEVICE_ENV = "MEGATRON_NPU_DEVICE"


def environment(script: str | Path, device: str | None = None) -> dict[str, str]:
    """What a run of ``script`` needs in its environment beyond the caller's: the device for
    ``megatron_npu.auto`` (when given), the script's folder (the Megatron-LM checkout that holds
    ``megatron/training``) on ``PYTHONPATH`` before what is there already, and
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless set (Megatron-LM asserts it for tensor/sequence-
    parallel overlap; its own examples set it)."""
    folder = str(Path(script).resolve().parent)
    paths = [folder, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
    }
    if device is not None:
        env[DEVICE_ENV] = device
    return env


@contextlib.contextmanager
def _kernel_counts(prefix: str) -> Iterator[None]:
    from megatron_npu import active_device

    if not prefix or active_device() != NPU_EMULATED:
        yield
        return
    from megatron_npu.testing.torch_npu_emulation import count_kernel_calls

    with count_kernel_calls() as counter:
        try:
            yield
        finally:
            path = f"{prefix}.rank{os.environ.get('RANK', '0')}.json"
            with open(path, "w", encoding="utf-8") as out:
                json.dump(dict(counter), out, sort_keys=True)


def prepare(argv: list[str]) -> str:
    """Apply the adaptor (``megatron_npu.auto``) and make ``argv`` (the script, then its own
    arguments) the script's ``sys.argv`` with its folder first on ``sys.path``; return the
    script's absolute path. Exits 2 with one line naming what was wrong when there is no script,
    when ``$MEGATRON_NPU_DEVICE`` names no device or one that cannot be used here, and when a
    patch cannot be applied."""
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        console.error(f"megatron-npu run_script: no script {argv[0]!r}")
        raise SystemExit(2)
    # the script's folder first, as ``python SCRIPT`` has it from the start: the adaptor then
    # sees Megatron-LM's training layer when it is applied
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script, *argv[1:]]
    from megatron_npu.devices import DeviceUnavailableError, UnknownDeviceError
    from megatron_npu.patcher import PatchError

    try:
        import megatron_npu.auto  # noqa: F401  (the one line)
    except (DeviceUnavailableError, UnknownDeviceError, PatchError) as exc:
        # the device or the adaptor cannot serve this run: one line per node, not a traceback
        # from every rank
        if os.environ.get("LOCAL_RANK", "0") == "0":
            console.error(f"megatron-npu run_script: {exc}")
        raise SystemExit(2) from None
    _nudge_initial_weights()
    return script


def _nudge_initial_weights() -> None:
    """``$MEGATRON_NPU_INIT_ULP_NUDGE=K``: every model Megatron-LM builds starts K ulps away
    (:mod:`megatron_npu.training.weight_nudge`); one line and exit 2 when it cannot be done."""
    from megatron_npu.training import weight_nudge

    try:
        weight_nudge.nudge_megatron_lm_models(weight_nudge.ulps_from_environment())
    except ValueError as exc:
        _stop(str(exc))
    except ImportError:
        _stop(f"${weight_nudge.ENV} needs Megatron-LM's training layer (megatron.training)")


def _stop(message: str) -> None:
    """One line from the node's first rank, exit 2 from every rank."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        console.error(f"megatron-npu run_script: {message}")
    raise SystemExit(2)


def run(script: str) -> None:
    """Run the prepared script as ``__main__`` (counting kernels when asked). A script asked to
    start from nudged weights that never built its model through Megatron-LM's ``get_model``
    ends with exit 2 and one line: its run would pass for a perturbed one."""
    from megatron_npu.training import weight_nudge

    with _kernel_counts(os.environ.get(KERNEL_COUNTS_ENV, "")):
        runpy.run_path(script, run_name="__main__")
    if weight_nudge.ulps_from_environment() and not weight_nudge.nudged_models:
        _stop(
            f"${weight_nudge.ENV}: the script built no model through Megatron-LM's get_model, "
            "so its initial weights were not nudged"
        )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        console.say(__doc__)
        raise SystemExit(0 if argv else 2)
    run(prepare(argv))


if __name__ == "__main__":
    main()
