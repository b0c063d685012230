"""When a run that was given valid input still trains nothing, stop it with a named reason.

Every rank runs the same :class:`Guard` on the same global figures (the all-reduced loss, the
learning rate, whether the optimizer skipped the update), so every rank stops at the same step
and none waits in a collective for another. A stop raises
:class:`~megatron_npu.training.errors.TrainingStopped` (exit status 3, distinct from bad input's
2); the loop records the reason in the metrics file first, and skips any save while the last
loss is NaN/inf (:attr:`Guard.diverging`), so the last good checkpoint stays the latest.
``--no-divergence-stop`` turns the guard off.

The rules (``N`` = ``--divergence-steps``, default :data:`DEFAULT_STEPS`):

* ``nonfinite-loss``: the lm loss is NaN or inf for ``N`` consecutive steps (checked after each
  step), or the run ends with a NaN/inf loss (checked at its end: its weights are not usable);
* ``all-skipped``: the loss scaler skipped the update at every step of the run (fp16 whose
  gradients overflow at every scale) -- checked at the end; and ``stuck-loss-scale``: ``N``
  consecutive steps skipped at the scaler's smallest scale (``--min-loss-scale``, or a static
  ``--loss-scale``), where it cannot back off further -- checked after each step;
* ``zero-lr``: the learning rate was 0 at every step of the run (e.g. a resume with
  ``--use-checkpoint-opt_param-scheduler`` past the checkpoint's schedule) -- checked at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_npu.training.errors import STOPPED_EXIT_STATUS, TrainingStopped

DEFAULT_STEPS = 5
OPT_OUT = "--no-divergence-stop"


def _finite(loss: float | None) -> bool:
    return loss is None or math.isfinite(loss)


@dataclass
class Guard:
    """Watches one run's steps; :meth:`after_step` and :meth:`at_end` raise on a stop."""

    steps_limit: int = DEFAULT_STEPS
    enabled: bool = True
    min_loss_scale: float | None = None  # the scaler's floor (fp16), None without a scaler
    first: int | None = None
    last: int | None = None
    nonfinite_run: list[int] = field(default_factory=list)
    stuck_run: list[int] = field(default_factory=list)
    scale: float | None = None  # the loss scale the next step runs with (after the last one)
    steps: int = 0
    skipped: int = 0
    zero_lr: int = 0

    def _stop(self, reason: str, message: str, remedy: str) -> TrainingStopped:
        return TrainingStopped(reason, message, f"{remedy}; {OPT_OUT} lets such a run go on")

    @property
    def diverging(self) -> bool:
        """The last step's loss was NaN/inf (and the guard is on): a save now would replace the
        last good checkpoint with unusable weights."""
        return self.enabled and bool(self.nonfinite_run)

    def after_step(
        self,
        step: int,
        loss: float | None,
        skipped: bool,
        lr: float,
        loss_scale: float | None = None,
    ) -> None:
        """Record one step (``loss_scale``: the scale after it); raise when the loss has been
        NaN/inf, or the update skipped at the smallest loss scale, for ``steps_limit`` steps."""
        self.first = step if self.first is None else self.first
        self.last = step
        self.steps += 1
        self.skipped += bool(skipped)
        self.zero_lr += lr == 0.0
        if _finite(loss):
            self.nonfinite_run.clear()
        else:
            self.nonfinite_run.append(step)
        floor, during = self.min_loss_scale, self.scale
        self.scale = loss_scale
        if skipped and floor is not None and during is not None and during <= floor:
            self.stuck_run.append(step)  # skipped although it ran at the floor already
        else:
            self.stuck_run.clear()
        if self.enabled and len(self.stuck_run) >= self.steps_limit:
            run = self.stuck_run
            raise self._stop(
                "stuck-loss-scale",
                f"the loss scaler skipped the update at {len(run)} consecutive iterations "
                f"({run[0]}..{run[-1]}) at its smallest loss scale {floor:g}: the gradients "
                "are inf/nan at every scale, the run trains nothing",
                "fp16 overflows here: use --bf16 or fp32, or lower --lr",
            )
        if self.enabled and len(self.nonfinite_run) >= self.steps_limit:
            run = self.nonfinite_run
            raise self._stop(
                "nonfinite-loss",
                f"the lm loss was NaN/inf for {len(run)} consecutive iterations "
                f"({run[0]}..{run[-1]}): the run diverged",
                "lower --lr, add warm-up (--lr-warmup-iters) or gradient clipping "
                "(--clip-grad), or use bf16/fp32",
            )

    def at_end(self) -> None:
        """Raise when the whole run trained nothing (see the module docstring)."""
        if not self.enabled or not self.steps:
            return
        span = f"({self.first}..{self.last})"
        run = self.nonfinite_run
        if run:
            where = (
                f"at every iteration of this run {span}"
                if len(run) == self.steps
                else f"at the last {len(run)} iterations of this run ({run[0]}..{run[-1]})"
            )
            raise self._stop(
                "nonfinite-loss",
                f"the lm loss was NaN/inf {where}: the run diverged",
                "lower --lr, add warm-up (--lr-warmup-iters) or gradient clipping "
                "(--clip-grad), or use bf16/fp32",
            )
        if self.skipped == self.steps:
            raise self._stop(
                "all-skipped",
                f"the loss scaler skipped the update at every iteration of this run {span} "
                "(the gradients were inf/nan at every loss scale): it trained nothing",
                "fp16 overflows here: use --bf16 or fp32, or a lower --initial-loss-scale",
            )
        if self.zero_lr == self.steps:
            raise self._stop(
                "zero-lr",
                f"the learning rate was 0 at every iteration of this run {span}: it trained "
                "nothing",
                "raise --lr; when resuming past the checkpoint's schedule, pass "
                "--override-opt_param-scheduler instead of --use-checkpoint-opt_param-scheduler",
            )

    def record(self, stop: TrainingStopped) -> dict:
        """What the metrics file records about ``stop``."""
        return {
            "reason": stop.reason,
            "message": str(stop),
            "iteration": self.last,
            "exit_status": STOPPED_EXIT_STATUS,
        }
