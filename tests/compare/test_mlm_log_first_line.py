"""Megatron-LM 0.16+ logs a process's first iteration without restarting its sums there, so the
next line averages over both intervals; compare's log importer gives every line its own
interval's figures. Checked against the same runs' TensorBoard folders (per-iteration scalars,
which never carried the sums) and against hand-made logs of known per-iteration values."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_npu.compare import mlm_log, tensorboard_events

GPT345M = Path(__file__).resolve().parents[3] / "shared" / "gpu-logs" / "h100-gpt345m"
#: the loss is printed as {:.6E} (relative 5e-7); the corrected line is two printed values apart
PRINTED = 1.5e-6


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_h100_log_losses_are_its_tensorboard_losses_step_by_step(precision):
    """Native core_v0.16.1 runs with ``--log-interval 1``: iteration 2's logged loss is the mean
    of iterations 1 and 2; imported, every iteration is TensorBoard's own value."""
    log = {
        r["iteration"]: r
        for r in mlm_log.parse(GPT345M / f"mlm-native-{precision}.log")["iterations"]
    }
    board = tensorboard_events.read(GPT345M / f"mlm-native-{precision}-tb")["scalars"]["lm loss"]
    assert set(log) == set(board) and len(log) > 2
    worst = max(abs(log[i]["lm_loss"] - board[i]) / board[i] for i in log)
    assert worst <= PRINTED, worst


ARGS = """------------------------ arguments ------------------------
  log_interval .................................... {interval}
  train_iters ..................................... 8
{marker}-------------------- end of arguments ---------------------
"""
MARKER = "  fake_process_group .............................. False\n"


def _line(it: int, loss: float | None, ms: float, skipped: int) -> str:
    lm = f" lm loss: {loss:.6E} |" if loss is not None else ""
    return (
        f" [2026-11-28 00:00:00] iteration {it:8d}/       8 | consumed samples: {4 * it:12d} "
        f"| elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.000000E-03 | global "
        f"batch size:     4 |{lm} loss scale: 1.0 | grad norm: 0.500 | number of skipped "
        f"iterations: {skipped:3d} | number of nan iterations:   0 |\n"
    )


def _log(tmp_path: Path, interval: int, marker: str, lines: list[str], restart: list[str]) -> dict:
    text = ARGS.format(interval=interval, marker=marker) + "".join(lines)
    if restart:
        text += ARGS.format(interval=interval, marker=marker) + "".join(restart)
    path = tmp_path / "run.log"
    path.write_text(text)
    return {r["iteration"]: r for r in mlm_log.parse(path)["iterations"]}


def test_first_interval_after_each_start_is_its_own(tmp_path):
    """``--log-interval 2``: iteration 1 (loss 6.0, 300 ms) is logged alone, and iteration 2's
    line averages 1-2 (6.0 and 5.0 -> 5.5; 300 and 100 ms -> 200); a restart at iteration 5 does
    the same with 5-6, where iteration 6 was skipped (no loss of its own, one skipped)."""
    lines = [_line(1, 6.0, 300.0, 0), _line(2, 5.5, 200.0, 0), _line(4, 4.5, 100.0, 0)]
    restart = [_line(5, 4.0, 500.0, 0), _line(6, 4.0, 300.0, 1), _line(8, 3.5, 100.0, 0)]
    got = _log(tmp_path, 2, MARKER, lines, restart)
    assert got[2]["lm_loss"] == pytest.approx(5.0) and got[2]["step_time_ms"] == 100.0
    assert got[4]["lm_loss"] == 4.5 and got[1]["lm_loss"] == 6.0
    assert "lm_loss" not in got[6] and got[6]["skipped"] == 1.0
    assert got[6]["step_time_ms"] == 100.0 and got[8]["lm_loss"] == 3.5


def test_a_first_line_of_a_skipped_iteration_leaves_the_next_as_printed(tmp_path):
    """A skipped first iteration adds no loss to the sums (fp16's loss scaler backing off): the
    next line's loss is its own already; its skipped count loses the first's."""
    lines = [_line(1, None, 300.0, 1), _line(2, 5.0, 200.0, 1), _line(3, 4.0, 100.0, 0)]
    got = _log(tmp_path, 1, MARKER, lines, [])
    assert got[2]["lm_loss"] == 5.0 and got[2]["skipped"] == 0.0 and got[2]["step_time_ms"] == 100.0


def test_releases_before_0_16_are_read_as_printed(tmp_path):
    """0.13-0.15 restart their sums at every logged line: no argument of 0.16's in the dump, no
    change."""
    lines = [_line(1, 6.0, 300.0, 0), _line(2, 5.5, 200.0, 0)]
    got = _log(tmp_path, 1, "", lines, [])
    assert got[2]["lm_loss"] == 5.5 and got[2]["step_time_ms"] == 200.0
