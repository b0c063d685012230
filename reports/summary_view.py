"""The summary banner and the provenance section: counts per kind and who ran what where."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from megatron_npu.reports import compare_view
from megatron_npu.reports.formatting import device_label, number
from megatron_npu.reports.inputs import ResultSet


def _devices(pairs: list[tuple[str, bool | None]]) -> list[dict[str, Any]]:
    """Distinct devices, each with the emulation badge where it applies; never merged by name
    prefix (``npu-emulated`` and ``npu`` stay two entries)."""
    seen: dict[str, dict[str, Any]] = {}
    for name, emulated in pairs:
        label = device_label(name, emulated)
        if name in seen:
            seen[name]["emulated"] = seen[name]["emulated"] or label["emulated"]
        else:
            seen[name] = label
    return [seen[k] for k in sorted(seen)]


def banner(rs: ResultSet, bench_flags: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    if rs.parity:
        rows.append(
            {
                "kind": "parity cells",
                "counts": Counter(c.verdict.status for c in rs.parity),
                "devices": _devices([(c.device, None) for c in rs.parity]),
            }
        )
    if rs.comparisons:
        runs = [r for comp in rs.comparisons for r in comp.runs]
        rows.append(
            {
                "kind": "end-to-end rule verdicts",
                "counts": Counter(v.status for comp in rs.comparisons for v in comp.verdicts),
                "devices": _devices([(r.device, r.emulated) for r in runs if r.device]),
            }
        )
        rows.append(
            {
                "kind": "training runs",
                "counts": Counter(r.status for r in runs),
                "devices": _devices([(r.device, r.emulated) for r in runs if r.device]),
            }
        )
    if rs.benchmark_files:
        rows.append(
            {
                "kind": "benchmarks",
                "counts": Counter(bench_flags),
                "devices": _devices([(b.device, b.emulated) for b in rs.benches]),
            }
        )
    for info in rs.infos:
        name = str(info.device.get("name", "unknown"))
        rows.append(
            {
                "kind": f"patches (info: {name})",
                "counts": Counter(str(p.get("status")) for p in info.patches),
                "devices": _devices([(name, info.device.get("emulated"))]),
            }
        )
    if rs.skipped:
        rows.append(
            {
                "kind": "inputs skipped",
                "counts": Counter({"skipped": len(rs.skipped)}),
                "devices": [],
            }
        )
    return rows


_PARITY_PROVENANCE = (
    "python",
    "torch",
    "torch_npu",
    "megatron_core",
    "hypothesis",
    "hostname",
    "device_name",
)


def parity_provenance(rs: ResultSet) -> list[dict[str, Any]]:
    """Parity records grouped by where they were produced (versions, commit, host, device)."""
    groups: dict[tuple[Any, ...], list[Any]] = defaultdict(list)
    for cell in rs.parity:
        prov = cell.to_data()["provenance"]
        git = prov.get("git") if isinstance(prov.get("git"), dict) else {}
        commit = git.get("commit")
        if commit and git.get("dirty"):
            commit = f"{commit} (dirty)"
        key = (cell.device, commit, *(prov.get(k) for k in _PARITY_PROVENANCE))
        groups[key].append(cell)
    rows = []
    for key, cells in sorted(groups.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
        stamps = sorted(c.provenance.timestamp_utc for c in cells)
        seeds = sorted({c.provenance.seed for c in cells}, key=str)
        rows.append(
            {
                "device": device_label(key[0]),
                "commit": key[1] or "-",
                "fields": dict(
                    zip(
                        _PARITY_PROVENANCE,
                        (k if k is not None else "-" for k in key[2:]),
                        strict=True,
                    )
                ),
                "records": len(cells),
                "seeds": ", ".join(str(s) for s in seeds),
                "from": stamps[0],
                "to": stamps[-1],
                "schemas": ", ".join(str(v) for v in sorted({c.schema_version for c in cells})),
            }
        )
    return rows


def compare_provenance(rs: ResultSet) -> list[dict[str, Any]]:
    return [
        {
            "title": comp.title,
            "source": comp.source,
            "created": comp.created or "-",
            "fields": {
                k: number(v) if not isinstance(v, list) else " ".join(map(str, v))
                for k, v in comp.provenance.items()
            },
            "runs": compare_view.run_provenance(comp),
        }
        for comp in rs.comparisons
    ]


def benchmark_provenance(rs: ResultSet) -> list[dict[str, Any]]:
    out = []
    for f in rs.benchmark_files:
        machine = {k: v for k, v in f.machine_info.items() if not isinstance(v, dict | list)}
        cpu = f.machine_info.get("cpu")
        if isinstance(cpu, dict) and cpu.get("brand_raw"):
            machine["cpu"] = cpu["brand_raw"]
        commit = {k: v for k, v in f.commit_info.items() if not isinstance(v, dict | list)}
        out.append(
            {
                "source": f.source,
                "datetime": f.datetime or "-",
                "version": f.version or "-",
                "machine": machine,
                "commit": commit,
                "devices": _devices([(b.device, b.emulated) for b in f.benches]),
            }
        )
    return out


def info_provenance(rs: ResultSet) -> list[dict[str, Any]]:
    return [
        {
            "source": i.source,
            "device": device_label(str(i.device.get("name", "unknown")), i.device.get("emulated")),
            "description": i.device.get("description", ""),
            "versions": i.versions,
            "patches": i.patches,
        }
        for i in rs.infos
    ]
