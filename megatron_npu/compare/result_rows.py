"""What compare writes for each run: its entry in ``results.json`` and its row of Table 2."""

from __future__ import annotations

from typing import Any

from megatron_npu.compare import table2
from megatron_npu.compare.judging import RunResult, perf_record
from megatron_npu.formats.metrics import RunConfig, Summary


def run_entry(result: RunResult, warmup: int) -> dict[str, Any]:
    curve = result.curve()
    outcome = result.outcome
    return {
        "name": result.spec.name,
        "device": result.device,
        "emulated": result.emulated,
        "options": result.spec.options,
        "config_hash": outcome.config_hash if outcome else None,
        "fingerprint": result.fingerprint() if result.metrics else {},
        "status": outcome.status if outcome else "failed",
        "error": outcome.error if outcome else "not run",
        "wall_s": outcome.wall_s if outcome else 0.0,
        "command": outcome.command if outcome else [],
        "metrics_path": f"runs/{result.spec.name}/metrics.json",
        "steps": [
            {"iteration": i, "loss": loss, "grad_norm": g, "step_time_s": t}
            for i, loss, g, t in zip(
                curve.iterations, curve.losses, curve.grad_norms, curve.step_times, strict=True
            )
        ],
        "perf": perf_record(result, warmup),
        "lambada": result.lambada,
        "reference": result.spec.reference,
        "kind": result.spec.kind,
        "hardware": result.spec.hardware,
        "imported_from": result.provenance,
        "notes": result.notes,
    }


def table_row(
    result: RunResult, entry: dict[str, Any], cell: str, band: str | None = None
) -> dict[str, Any]:
    perf = entry["perf"] or {}
    summary = result.metrics.summary if result.metrics else Summary()
    config = result.metrics.config if result.metrics else RunConfig(arguments={})
    args = result.arguments or {k.replace("-", "_"): v for k, v in result.spec.options.items()}
    return {
        "name": result.spec.name,
        "device": result.device or "/".join(result.spec.devices),
        "hardware": result.spec.hardware,
        "emulated": result.emulated,
        "layout": table2.layout_of(
            {**args, "data_parallel_size": config.data_parallel_size}, config.world_size
        ),
        "precision": table2.precision_of(args),
        "first_loss": summary.first_lm_loss,
        "last_loss": summary.last_lm_loss,
        "s_per_step": perf.get("median_s_per_step"),
        "s_per_step_ci95": perf.get("ci95_s_per_step"),
        "tokens_per_s": perf.get("tokens_per_s"),
        "mfu": perf.get("mfu"),
        "mfu_ci95": perf.get("ci95_mfu"),
        "peak_understated": perf.get("peak_understated", False),
        "peak_allocated_mib": perf.get("peak_allocated_mib"),
        "peak_rss_mib": perf.get("peak_rss_mib"),
        "cloze_set": table2.cloze_set(result.lambada.data) if result.lambada else None,
        "cloze_accuracy": result.lambada.accuracy if result.lambada else None,
        "cloze_nll": result.lambada.target_nll if result.lambada else None,
        "noise_band": band,
        "verdict": cell,
    }
