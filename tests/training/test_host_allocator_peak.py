"""The host's allocator peak (cpu, npu-emulated): the profiler's count, checked against
allocations of known size and against the bounds a real training run must respect."""

from __future__ import annotations

import torch

from megatron_npu.formats.metrics import RunConfig
from megatron_npu.training import host_allocator_peak as host_peak

MIB = 2**20


def _floats(mib: int) -> torch.Tensor:
    return torch.empty(mib * MIB // 4, dtype=torch.float32)


def test_net_peak_is_the_most_held_at_once_on_top_of_the_start():
    with host_peak.measure() as measured:
        a = _floats(2)
        del a  # freed: 2 MiB held at most so far
        b, c = _floats(3), _floats(1)  # 4 MiB held together
        del b, c
        d = _floats(1)
    assert measured.net_peak_bytes == 4 * MIB
    del d


def test_live_bytes_count_each_storage_once():
    before = host_peak.live_storage_bytes()
    kept = _floats(3)
    views = [kept[:10], kept.view(-1, 4), kept[1:]]  # noqa: F841 - views share kept's storage
    assert host_peak.live_storage_bytes() - before == 3 * MIB
    with host_peak.measure() as measured:
        pass
    assert measured.live_bytes >= 3 * MIB and measured.net_peak_bytes == 0
    assert measured.peak_bytes == measured.live_bytes


def test_measuring_prints_nothing_on_stderr(capfd):
    with host_peak.measure():
        _floats(1)
    assert "USDT" not in capfd.readouterr().err


def _parameter_count(config: RunConfig) -> int:
    """GPT's parameters from the run's own config (the formula of Megatron-LM's
    ``num_floating_point_operations`` inputs): embeddings + layers + final norm."""
    args = config.arguments
    h, layers = args["hidden_size"], args["num_layers"]
    ffn = args.get("ffn_hidden_size") or 4 * h
    vocab, seq = config.padded_vocab_size, args["seq_length"]
    per_layer = 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h  # attention, MLP, two norms
    return vocab * h + seq * h + layers * per_layer + 2 * h


def test_a_cpu_run_reports_the_allocator_peak_and_its_rss_apart(baseline):
    summary, config = baseline.metrics.summary, baseline.metrics.config
    assert summary.peak_memory_measure == "allocator"
    assert summary.peak_memory_source == host_peak.SOURCE
    # fp32 Adam under Megatron: the weights, their fp32 main grads and two moments, at least
    floor = 16 * _parameter_count(config)
    assert floor <= summary.peak_memory_bytes < summary.peak_rss_bytes
    # and the step's activations on top, far below the process's resident set
    assert summary.peak_memory_bytes < floor + 4 * 2**20
    assert "peak allocated" in baseline.stdout and "process peak RSS" in baseline.stdout
    assert "USDT" not in baseline.stdout
