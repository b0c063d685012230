"""The smallest train options a matrix's train run can have. compare checks every train run's
options with train's own parser when it reads a matrix, so a test matrix carries them."""

from __future__ import annotations

TRAIN_DEFAULTS = {
    "num-layers": 2,
    "hidden-size": 64,
    "num-attention-heads": 4,
    "seq-length": 64,
    "micro-batch-size": 2,
    "train-iters": 3,
    "lr": 0.001,
}
#: TRAIN_DEFAULTS as a matrix's [defaults] table
DEFAULTS = "[defaults]\n" + "".join(f"{key} = {value}\n" for key, value in TRAIN_DEFAULTS.items())
