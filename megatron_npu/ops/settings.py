"""Run-wide choices for the fused-op patches that Megatron's config has no field for.

The large-kernel variants of Ascend's Megatron-LM adaptation guide pick the attention input
layout (``--shape-order SBH|BSH``) and the pre/next-token window (``--pre-tokens`` /
``--next-tokens``); ``megatron-npu train`` sets them here before building the model, and the
fused ``DotProductAttention`` patch reads them at call time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: ``pre_tokens``/``next_tokens`` at or above this mean "no window" (the guide's scripts use 65536).
FULL_WINDOW = 65536


@dataclass(frozen=True)
class FusedAttentionSettings:
    use_flash_attn: bool = False
    shape_order: str = "SBH"
    pre_tokens: int = FULL_WINDOW
    next_tokens: int = FULL_WINDOW

    def __post_init__(self) -> None:
        if self.shape_order not in ("SBH", "BSH"):
            raise ValueError(f"shape_order must be SBH or BSH, got {self.shape_order!r}")
        if self.pre_tokens < 0 or self.next_tokens < 0:
            raise ValueError(
                "pre_tokens and next_tokens must be >= 0, "
                f"got {self.pre_tokens}, {self.next_tokens}"
            )

    @property
    def windowed(self) -> bool:
        return self.pre_tokens < FULL_WINDOW or self.next_tokens < FULL_WINDOW

    def fused_only_options(self) -> list[str]:
        """The choices Megatron's unfused attention cannot express, written as the options that
        ask for them (``megatron-npu train`` names them when nothing serves the fused kernel)."""
        wants = []
        if self.use_flash_attn:
            wants.append("--use-flash-attn")
        if self.pre_tokens < FULL_WINDOW:
            wants.append(f"--pre-tokens {self.pre_tokens}")
        if self.next_tokens < FULL_WINDOW:
            wants.append(f"--next-tokens {self.next_tokens}")
        if self.shape_order != "SBH":
            wants.append(f"--shape-order {self.shape_order}")
        return wants

    @property
    def needs_fused_kernel(self) -> bool:
        """Whether Megatron's unfused attention cannot express this choice."""
        return bool(self.fused_only_options())


_current = FusedAttentionSettings()


def fused_attention() -> FusedAttentionSettings:
    return _current


def set_fused_attention(**changes: object) -> FusedAttentionSettings:
    """Replace some fields (validated); returns the new settings."""
    global _current
    _current = replace(_current, **changes)
    return _current


def reset() -> None:
    global _current
    _current = FusedAttentionSettings()
