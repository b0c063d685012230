"""Make an msprobe dump of one training step of a small Llama-style stack (RMSNorm, SwiGLU MLP,
tied output), on the CPU: ``python _msprobe_dump.py LEVEL TASK OUT [--plant | --plant-kernel]``,
and more dumps after ``--``, each with arguments of the same form.

``--plant`` puts a 2 % error in the second layer's norm (half of its output features scaled by
1.02), the kind of error a fused kernel makes: every later row inherits it. Both runs make the
same calls (the scale is a buffer, ones when nothing is planted), so msprobe names their rows
alike, as it does for a fused kernel that computes wrongly.

``--plant-kernel`` makes ``torch.rsqrt`` itself 2 % off for every other sample, before msprobe
wraps it: the API-level picture (msprobe's default level ``L1`` records API calls alone) of a
kernel that computes wrongly from correct inputs.

msprobe is imported once (about 5 s of each dump's 6 s) and every dump is made in a child forked
from that process, so each has a ``PrecisionDebugger`` and a torch of its own, as a process of its
own would."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

HIDDEN, LAYERS, VOCAB = 32, 3, 64


class RMSNorm(torch.nn.Module):
    def __init__(self, planted: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))
        skew = torch.ones(HIDDEN)
        if planted:
            skew[: HIDDEN // 2] = 1.02
        self.register_buffer("skew", skew)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight * self.skew


class Layer(torch.nn.Module):
    def __init__(self, planted: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(planted)
        self.gate_up = torch.nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


class Model(torch.nn.Module):
    def __init__(self, plant: bool) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(Layer(plant and i == 1) for i in range(LAYERS))
        self.final_norm = RMSNorm()

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x) @ self.embedding.weight.t()


def _faulty(kernel):
    def faulty(x):
        out = kernel(x)
        skew = 1 + 0.02 * (torch.arange(out.shape[0]) % 2 == 0)
        return out * skew.reshape(-1, *[1] * (out.dim() - 1))

    return faulty


def dump(level: str, task: str, out: str, flags: list[str]) -> None:
    from msprobe.pytorch import PrecisionDebugger

    config = Path(out) / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        json.dumps(
            {
                "task": task,
                "dump_path": str(Path(out) / "dump"),
                "rank": [],
                "step": [],
                "level": level,
                "async_dump": False,
                task: {"scope": [], "list": [], "data_mode": ["all"]},
            }
        )
    )
    torch.manual_seed(0)
    if "--plant-kernel" in flags:
        torch.rsqrt = _faulty(torch.rsqrt)
    model = Model("--plant" in flags)
    tokens = torch.randint(0, VOCAB, (4, 16))
    debugger = PrecisionDebugger(config_path=str(config))
    debugger.start(model=model)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    debugger.stop()
    debugger.step()


def main(argv: list[str]) -> int:
    import msprobe.pytorch  # noqa: F401  (imported once, before the children fork)

    jobs, job = [], []
    for arg in [*argv, "--"]:
        if arg == "--":
            jobs.append(job)
            job = []
        else:
            job.append(arg)
    for level, task, out, *flags in jobs:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child makes one dump and leaves without the parent's exit handlers
            status = 1
            try:
                dump(level, task, out, flags)
                status = 0
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            print(f"the dump to {out} failed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
