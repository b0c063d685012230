"""An imported run (a metrics file, a Megatron-LM log, a TensorBoard folder) as a compare run."""

from __future__ import annotations

from megatron_npu import console
from megatron_npu.compare import datasheet, imports, runner
from megatron_npu.compare.judging import RunResult, precision_of
from megatron_npu.compare.matrix import RunSpec
from megatron_npu.devices import facts as device_facts
from megatron_npu.formats.metrics import Peak


def _datasheet_peak(result: RunResult) -> None:
    """An imported run without a peak of its own (a Megatron-LM log or event folder) gets the
    datasheet peak of the GPU its ``hardware`` label names (:mod:`.datasheet`), per device,
    times its world size; the MFU column then reads against it."""
    summary = result.metrics.summary
    if summary.peak or result.emulated:
        return
    args = result.arguments
    found = datasheet.peak(result.spec.hardware, precision_of(args))
    if found is None:
        return
    tflops, detail = found
    world = result.metrics.config.world_size or args.get("world_size") or 1
    summary.peak = Peak(tflops=tflops, source="datasheet", detail=detail)
    summary.peak_devices = int(world)


def import_run(spec: RunSpec) -> RunResult:
    """An imported run (:mod:`.imports`), or a failed one whose error names the file and line."""
    try:
        imported = imports.load(str(spec.path), spec.import_run)
    except imports.ImportedRunError as exc:
        console.say(f" [compare] {spec.name}: FAILED to import ({exc})")
        return RunResult(
            spec,
            spec.devices[0] if spec.devices else None,
            runner.Outcome("failed", str(exc), 0.0, [], ""),
        )
    device = spec.devices[0] if spec.devices else imported.device
    if device is None:
        error = (
            f"{spec.path}: the file does not say which device ran it: "
            "set device = ... in the matrix"
        )
        console.say(f" [compare] {spec.name}: FAILED to import ({error})")
        return RunResult(spec, None, runner.Outcome("failed", error, 0.0, [], ""))
    result = RunResult(
        spec,
        device,
        runner.Outcome("imported", None, 0.0, [], imported.provenance.get("sha256") or ""),
        metrics=imported.metrics,
        provenance=imported.provenance,
    )
    _datasheet_peak(result)
    if imported.device and imported.device != device:
        result.notes.append(f"the file says device {imported.device}; the matrix says {device}")
    if imported.emulated and not device_facts.emulated(device):
        result.notes.append("the file says its run was emulated")
    console.say(
        f" [compare] {spec.name}: imported {imported.provenance['kind']} {spec.path} ({device})"
    )
    return result
