"""Table 2 of the seeds ("competitor vs NPU: loss, s/step"), one row per run, as markdown.

Columns: name, device (emulated marked ``*``), layout, precision, first/last loss, s/step (median
after warm-up, with its 95 % bootstrap interval), tokens/s, MFU (with the interval that s/step
interval gives), peak memory, verdict.
"""

from __future__ import annotations

from typing import Any

from megatron_npu.ops.settings import FULL_WINDOW

COLUMNS = (
    ("name", "name"),
    ("device", "device"),
    ("layout", "layout"),
    ("precision", "precision"),
    ("first_loss", "first loss"),
    ("last_loss", "last loss"),
    ("s_per_step", "s/step [95% CI]"),
    ("tokens_per_s", "tokens/s"),
    ("mfu", "MFU [95% CI]"),
    ("peak_memory_mib", "peak MiB"),
    ("lambada", "LAMBADA acc (target nll)"),
    ("verdict", "verdict"),
)
EMULATED_NOTE = "`*` emulated: the NPU code path run on CPU through the torch_npu emulation; its speed is not NPU performance."


def layout_of(arguments: dict[str, Any], world_size: int | None) -> str:
    tp = arguments.get("tensor_model_parallel_size", 1)
    pp = arguments.get("pipeline_model_parallel_size", 1)
    dp = arguments.get("data_parallel_size") or (world_size // (tp * pp) if world_size else 1)
    parts = [f"TP{tp}", f"PP{pp}"]
    if arguments.get("virtual_pipeline_model_parallel_size"):
        parts.append(f"VPP{arguments['virtual_pipeline_model_parallel_size']}")
    parts.append(f"DP{dp}")
    if arguments.get("sequence_parallel"):
        parts.append("SP")
    if arguments.get("use_distributed_optimizer"):
        parts.append("distopt")
    return " ".join(parts)


def precision_of(arguments: dict[str, Any]) -> str:
    base = "bf16" if arguments.get("bf16") else "fp16" if arguments.get("fp16") else "fp32"
    attention = []
    if arguments.get("use_flash_attn"):
        attention.append("flash")
    window = (arguments.get("pre_tokens"), arguments.get("next_tokens"))
    if any(w is not None and w < FULL_WINDOW for w in window):
        attention.append(f"window {window[0]}/{window[1]}")
    if arguments.get("shape_order") == "BSH":
        attention.append("BSH")
    return base + (f" ({', '.join(attention)})" if attention else "")


def _fmt(key: str, row: dict[str, Any]) -> str:
    value = row.get(key)
    if key == "device":
        return f"{value}*" if row.get("emulated") else str(value)
    if key == "mfu" and row.get("peak_understated"):
        return "n/a (peak understated)"
    if value is None:
        return "-"
    if key in ("first_loss", "last_loss"):
        return f"{value:.4f}"
    if key == "s_per_step":
        ci = row.get("s_per_step_ci95")
        return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"
    if key == "tokens_per_s":
        return f"{value:.0f}"
    if key == "mfu":
        ci = row.get("mfu_ci95")
        text = f"{100 * value:.2f}%"
        return f"{text} [{100 * ci[0]:.2f}, {100 * ci[1]:.2f}]" if ci else text
    if key == "peak_memory_mib":
        return f"{value:.0f}"
    if key == "lambada":
        nll = row.get("lambada_nll")
        return f"{100 * value:.1f}%" + (f" (nll {nll:.3f})" if nll is not None else "")
    return str(value)


def markdown(rows: list[dict[str, Any]], title: str = "") -> str:
    lines = [f"## {title}", ""] if title else []
    lines.append("| " + " | ".join(label for _, label in COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for row in rows:
        lines.append(
            "| " + " | ".join(_fmt(key, row).replace("|", "/") for key, _ in COLUMNS) + " |"
        )
    if any(row.get("emulated") for row in rows):
        lines += ["", EMULATED_NOTE]
    return "\n".join(lines) + "\n"
