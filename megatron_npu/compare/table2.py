"""Table 2 of Ascend's Megatron-LM adaptation guide ("competitor vs NPU: loss, s/step"), one row per
run, as markdown.

Columns (:data:`COLUMNS`, labels with units): run, device (emulated marked ``*``, with its
hardware label), layout, precision, first/last loss, s/step (median after warm-up, with its 95 %
bootstrap interval), tokens/s, MFU in % (with the interval the s/step interval gives; none for
emulated rows, :func:`megatron_npu.compare.rules.mfu_shown`), peak allocator memory and peak
process RSS (each one measure on every device), the cloze evaluation (:func:`cloze_label`),
the rounding band (where a matrix measured one: :func:`megatron_npu.compare.noise.band_cell`),
verdict.
"""

from __future__ import annotations

from typing import Any

from megatron_npu.ops.settings import FULL_WINDOW

#: (row key, column label with its unit): the one list the markdown and the HTML report use.
COLUMNS = (
    ("name", "run"),
    ("device", "device (hardware)"),
    ("layout", "layout"),
    ("precision", "precision"),
    ("first_loss", "first loss"),
    ("last_loss", "last loss"),
    ("s_per_step", "s/step [95% CI]"),
    ("tokens_per_s", "tokens/s"),
    ("mfu", "MFU % [95% CI]"),
    ("peak_allocated_mib", "peak allocated MiB"),
    ("peak_rss_mib", "peak RSS MiB"),
    ("cloze", "cloze"),  # labelled by :func:`cloze_label`
    ("noise_band", "rounding band"),  # shown when the matrix measured one (compare/noise.py)
    ("verdict", "verdict"),
)
EMULATED_NOTE = (
    "`*` emulated: the NPU code path run on CPU through the torch_npu emulation; "
    "its speed is not NPU performance (no MFU, no speed verdict)."
)
MEMORY_NOTE = (
    "peak allocated: the allocator's peak, largest over ranks (torch's max_memory_allocated on "
    "cuda/npu; on cpu and npu-emulated the profiler's count: live tensor storages plus the first "
    "step's net allocations); peak RSS: the process's peak resident set (cpu and npu-emulated "
    "rows, and Megatron-LM logs of a run on those devices)."
)
#: How the cloze column is headed: the LAMBADA test set only when the user gave one.
CLOZE_LABELS = {
    "lambada": "LAMBADA acc % (target NLL)",
    "corpus-cloze": "corpus cloze target NLL",
    "corpus-cloze-acc": "corpus cloze acc % (target NLL)",
}


def cloze_set(data: Any) -> str:
    """``lambada`` for a user-supplied lambada_test.jsonl-format file, ``corpus-cloze`` for the
    shipped set cut from the embedded corpus (the evaluation's own rule: ``lambada.set_name``)."""
    from megatron_npu.evaluate.lambada import set_name

    return set_name(data)


def cloze_label(rows: list[dict[str, Any]]) -> str:
    """The cloze column's heading: the shipped set reports its accuracy only where some run got
    a non-zero one (else target NLL alone: an all-zero accuracy column says nothing)."""
    sets = {row.get("cloze_set") for row in rows if row.get("cloze_set")}
    if sets == {"lambada"}:
        return CLOZE_LABELS["lambada"]
    if any(row.get("cloze_accuracy") for row in rows):
        return CLOZE_LABELS["corpus-cloze-acc"] if sets else CLOZE_LABELS["corpus-cloze"]
    return CLOZE_LABELS["corpus-cloze"]


def labels(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(key, label) of every column, the cloze column headed for these rows and left out when no
    run was evaluated (an empty matrix gets every column)."""
    evaluated = not rows or any(
        row.get("cloze_nll") is not None or row.get("cloze_accuracy") is not None for row in rows
    )
    banded = any(row.get("noise_band") for row in rows)
    return [
        (key, cloze_label(rows) if key == "cloze" else label)
        for key, label in COLUMNS
        if (key != "cloze" or evaluated) and (key != "noise_band" or banded)
    ]


def layout_of(arguments: dict[str, Any], world_size: int | None) -> str:
    tp = arguments.get("tensor_model_parallel_size", 1)
    pp = arguments.get("pipeline_model_parallel_size", 1)
    cp = arguments.get("context_parallel_size") or 1
    dp = arguments.get("data_parallel_size") or (world_size // (tp * pp * cp) if world_size else 1)
    parts = [f"TP{tp}", f"PP{pp}"]
    if arguments.get("virtual_pipeline_model_parallel_size"):
        parts.append(f"VPP{arguments['virtual_pipeline_model_parallel_size']}")
    if cp > 1:
        parts.append(f"CP{cp} {arguments.get('cp_comm_type') or 'p2p'}")
    parts.append(f"DP{dp}")
    ep, etp = (
        arguments.get("expert_model_parallel_size") or 1,
        arguments.get("expert_tensor_parallel_size"),
    )
    if arguments.get("num_experts") and (ep > 1 or (etp is not None and etp != tp)):
        parts.append(f"EP{ep}" + (f" ETP{etp}" if etp is not None and etp != tp else ""))
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


def cell(key: str, row: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> str:
    """What one cell shows (the markdown table and the HTML report alike)."""
    value = row.get(key)
    if key == "device":
        text = f"{value}*" if row.get("emulated") else str(value)
        hardware = row.get("hardware")
        return f"{text} ({hardware})" if hardware and hardware != value else text
    if key == "mfu" and row.get("emulated"):
        return "n/a (emulated)"
    if key == "mfu" and row.get("peak_understated"):
        return "n/a (peak understated)"
    if key == "cloze":
        nll, acc = row.get("cloze_nll"), row.get("cloze_accuracy")
        if nll is None and acc is None:
            return "-"
        label = cloze_label(rows or [row])
        nll_text = f"{nll:.3f}" if nll is not None else "-"
        if label == CLOZE_LABELS["corpus-cloze"]:
            return nll_text
        return f"{100 * (acc or 0.0):.1f} ({nll_text})"
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
        text = f"{100 * value:.2f}"
        return f"{text} [{100 * ci[0]:.2f}, {100 * ci[1]:.2f}]" if ci else text
    if key in ("peak_allocated_mib", "peak_rss_mib"):
        return f"{value:.0f}"
    return str(value)


def markdown(rows: list[dict[str, Any]], title: str = "") -> str:
    lines = [f"## {title}", ""] if title else []
    columns = labels(rows)
    lines.append("| " + " | ".join(label for _, label in columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        lines.append(
            "| " + " | ".join(cell(key, row, rows).replace("|", "/") for key, _ in columns) + " |"
        )
    lines += ["", MEMORY_NOTE]
    if any(row.get("emulated") for row in rows):
        lines += ["", EMULATED_NOTE]
    return "\n".join(lines) + "\n"
