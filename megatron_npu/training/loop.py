"""One rank of a training run: set-up, the train step, the loop (Megatron-LM's ``pretrain``).

The train step is Megatron-LM's ``train_step``: zero the DDP grad buffers, run the schedule from
``get_forward_backward_func`` (which calls ``config.finalize_model_grads_func`` =
``finalize_model_grads`` for the DP all-reduce / reduce-scatter, SP layer-norm grads and the tied
embedding grads), ``optimizer.step()`` (unscale + inf/nan check for fp16, clip, update), then the
scheduler when the update was applied. ``config.grad_scale_func`` is the optimizer's loss scaler;
with ``--overlap-grad-reduce`` ``no_sync_func``/``grad_sync_func`` come from DDP, with
``--overlap-param-gather`` and virtual stages ``param_sync_func`` does too -- as Megatron-LM's
``train`` sets them.

Loss reporting: the loss only exists on the last pipeline stage. Each last-stage rank with TP rank
0 contributes its micro-batches' ``[sum of token losses, token count]``; one all-reduce (SUM) over
the world gives every rank -- global rank 0 included, which writes the metrics -- the
token-weighted mean over the whole global batch.

"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from argparse import Namespace
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from megatron_npu import console, devices
from megatron_npu.ops.attention import causal_mask
from megatron_npu.training import (
    arguments,
    checkpointing,
    children,
    divergence,
    errors,
    flops,
    launch,
    memory_snapshots,
    metrics,
    moe_metrics,
    peak,
    profiling,
    quiet_expected_warnings,
    security,
    weight_nudge,
)
from megatron_npu.training import data as data_mod
from megatron_npu.training import host_allocator_peak as host_peak
from megatron_npu.training import model as model_mod
from megatron_npu.training import optimizer as optim_mod
from megatron_npu.training.rank_session import rank_session


def set_seeds(seed: int) -> None:
    """Megatron-LM's ``_set_random_seed``: ``seed + 100 * pp_rank`` for python, numpy, torch and
    the model-parallel RNG tracker (dropout streams; initial weights are seeded in
    :mod:`.model`, independently of the stage)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + model_mod.PP_SEED_STRIDE * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def configure_schedule(args: Namespace, config, model, optimizer) -> None:
    """The ``config`` hooks Megatron-LM's ``train`` sets before the first step."""
    from megatron.core.distributed import finalize_model_grads

    def one_or_list(funcs):
        return funcs[0] if len(funcs) == 1 else funcs

    config.grad_scale_func = optimizer.scale_loss
    config.timers = None
    if args.overlap_grad_reduce:
        config.no_sync_func = one_or_list([chunk.no_sync for chunk in model])
        config.grad_sync_func = one_or_list([chunk.start_grad_sync for chunk in model])
    if args.overlap_param_gather and len(model) > 1:
        config.param_sync_func = [chunk.start_param_sync for chunk in model]
    config.finalize_model_grads_func = finalize_model_grads


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt's loss: token-summed loss, token count, and ``[sum, count]`` for reporting."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    total = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    report = torch.stack([total.detach(), mask.sum().detach()])
    return total, tokens, {"lm loss": report}


def forward_step(device_type, data_iterator, model):
    gpt = model_mod.unwrap(model)
    batch = next(data_iterator) if data_iterator is not None else None
    seq = batch["tokens"].shape[-1] if batch is not None else None  # before a context-parallel cut
    if batch is not None and gpt.config.context_parallel_size > 1:
        batch = data_mod.context_parallel_rows(batch)

    def take(key, needed):
        if batch is None or not needed:
            return None
        return batch[key].to(device_type, non_blocking=True)

    tokens = take("tokens", gpt.pre_process)
    position_ids = take("position_ids", gpt.pre_process)
    if batch is not None and not data_mod.RESET_ATTENTION_MASK:
        # the plain causal mask, stated as such (the data layer builds none): attention
        # recognises the shared tensor by identity instead of comparing a copy on the host
        attention_mask = causal_mask(seq, seq, device=device_type)
    else:
        attention_mask = take("attention_mask", True)
    labels = take("labels", gpt.post_process)
    loss_mask = take("loss_mask", gpt.post_process)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask)


def reduce_loss(losses_reduced: list[dict]) -> float | None:
    """Token-weighted mean lm loss of the global batch, on every rank (one world all-reduce)."""
    from megatron.core import parallel_state

    local = torch.zeros(2, dtype=torch.float32)
    owner = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    if owner and losses_reduced:
        local = torch.stack([d["lm loss"].float().cpu() for d in losses_reduced]).sum(dim=0)
    device = devices.current_torch_device()
    total = local.to(device)
    torch.distributed.all_reduce(total)
    total = total.cpu()
    return float(total[0] / total[1]) if total[1] > 0 else None


def params_norm(model) -> float:
    """L2 norm of all parameters, each counted once (TP duplicates and shared copies skipped)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    checkpointing.sync_params(model)
    squares = torch.zeros(1, dtype=torch.float32, device=devices.current_torch_device())
    for chunk in model:
        for param in chunk.parameters():
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                squares += param.detach().float().pow(2).sum()
    torch.distributed.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    return math.sqrt(float(squares.item()))


def train_step(args, step, forward_backward, data_iterators, model, optimizer, scheduler, device):
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = forward_backward(
        forward_step_func=partial(forward_step, device.torch_device()),
        data_iterator=data_iterators if len(data_iterators) > 1 else data_iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=False,
    )
    lr = optim_mod.current_lr(optimizer)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    loss = reduce_loss(losses_reduced)
    return loss, (float(grad_norm) if grad_norm is not None else None), lr, not update_successful


def _timed_sync(device) -> float:
    device.accelerator.synchronize()
    return time.perf_counter()


def run(argv: list[str]) -> int:
    """One rank: parse, set up, train, save, report. Returns 0, or :data:`errors.EXIT_STATUS`
    after reporting a :class:`~.errors.TrainingInputError`, or :data:`errors.STOPPED_EXIT_STATUS`
    after a :class:`~.errors.TrainingStopped` (:mod:`.divergence`); exits 1 with one line (no
    traceback) when another rank went away."""
    quiet_expected_warnings()
    args = arguments.parse_args(argv)
    security.set_umask()
    env = launch.dist_env(args.master_addr, args.master_port)
    if "RANK" in os.environ:  # a launched rank: die with the launcher (torchrun's too)
        children.die_with_parent()
    with children.tie_children():  # checkpoint writers, Manager, resource tracker die with us
        return _run(args, env)


def _run(args, env) -> int:
    try:
        with rank_session(args, env) as device:
            return _train(args, env, device)
    except (errors.TrainingInputError, errors.TrainingStopped) as exc:
        return errors.report(exc)
    except Exception as exc:
        if not checkpointing.is_peer_failure(exc) or env.world_size == 1:
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        console.error(
            f"megatron-npu train: rank {env.rank}: another rank stopped ({first}); stopping"
        )
        return 1


def _describe_layout(args, device) -> str:
    vpp = args.virtual_pipeline_model_parallel_size
    cp = args.context_parallel_size
    return (
        f" megatron-npu train: {device.describe()} | world {args.world_size} = "
        f"TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size}"
        f"{f' (VPP {vpp})' if vpp else ''}"
        f"{f' x CP {cp} ({args.cp_comm_type})' if cp > 1 else ''}"
        f" x DP {args.data_parallel_size} | "
        f"{args.num_microbatches} micro-batches/step"
    )


def _set_throughput_basis(args, device, vocab: int, run_metrics, rank0: bool) -> None:
    """Model FLOPs per step (Megatron-LM's formula; causal attention, a pre/next window is not
    credited, as in Megatron; MoE layers count their active experts only) and, on rank 0, the
    peak MFU is measured against."""
    run_metrics.model_flops_per_step = flops.model_flops_per_step(args, vocab)
    if rank0:
        try:
            figure = peak.resolve_peak(device.name, model_mod.params_dtype(args), args.peak_tflops)
        except ValueError as exc:
            raise arguments.ArgumentError(str(exc)) from None
        run_metrics.peak = figure.as_dict()
        run_metrics.peak_devices = peak.aggregate_devices(device.name, args.world_size)
        console.say(
            f" model FLOPs per step: {run_metrics.model_flops_per_step:.4g} (Megatron-LM's GPT "
            f"formula: attention, MLP and logits GEMMs, forward + backward) | MFU against "
            f"{figure.tflops:.4g} TFLOP/s x {run_metrics.peak_devices} ({figure.source}: "
            f"{figure.detail})"
        )


def _throughput_note(summary: dict) -> str:
    if summary.get("achieved_tflops_per_s") is None:
        return ""
    note = f"{summary['achieved_tflops_per_s']:.4g} model TFLOP/s | "
    if summary.get("peak_understated"):
        note += (
            f"MFU n/a: above the {summary['peak']['tflops']:.4g} TFLOP/s peak "
            f"({summary['peak']['source']}; state --peak-tflops or delete the probe cache) | "
        )
    if summary.get("mfu") is not None:
        note += f"MFU {100.0 * summary['mfu']:.2f}% of {summary['peak']['tflops']:.4g} TFLOP/s peak"
        note += f" ({summary['peak']['source']}) | "
    return note


@dataclass
class Trainer:
    """What one rank trains with, built as Megatron-LM's ``setup_model_and_optimizer`` does."""

    args: Namespace
    device: object
    train_data: object
    vocab: int  # padded vocabulary
    model: list
    config: object
    optimizer: object
    scheduler: object
    forward_backward: object

    def step(self, step: int, iterators):
        """One training step (:func:`train_step`): ``(loss, grad norm, lr, skipped)``."""
        return train_step(
            self.args,
            step,
            self.forward_backward,
            iterators,
            self.model,
            self.optimizer,
            self.scheduler,
            self.device,
        )


def build_trainer(args, env, device) -> Trainer:
    """Finalize ``args`` for this world, build the parallel state, data, model and optimizer.
    The process group must exist (``launch.init_process_group``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    arguments.finalize(args, env.world_size)
    launch.init_model_parallel(args)
    set_seeds(args.seed)
    train_data = data_mod.build_train_data(args)
    vocab = model_mod.padded_vocab_size(train_data.vocab_size, args)
    args.padded_vocab_size = vocab
    args.tokenizer_vocab_size = train_data.vocab_size  # the checkpoint fingerprint's vocab_size
    model, config = model_mod.build(args, device, vocab, env.local_rank)
    weight_nudge.nudge(model, args.init_ulp_nudge)
    optimizer, scheduler = optim_mod.build(args, model)
    configure_schedule(args, config, model, optimizer)
    return Trainer(
        args,
        device,
        train_data,
        vocab,
        model,
        config,
        optimizer,
        scheduler,
        get_forward_backward_func(),
    )


def _rss_note(summary: dict) -> str:
    rss = summary.get("peak_rss_bytes")
    return f" (process peak RSS {rss / 2**20:.0f} MiB)" if rss else ""


def _loss_scales(args) -> tuple[float | None, float | None]:
    """fp16's loss scaler: the smallest scale it reaches and the one the first step runs with
    (a static scale is both); ``(None, None)`` without a scaler."""
    if not args.fp16:
        return None, None
    if args.loss_scale is not None:
        return float(args.loss_scale), float(args.loss_scale)
    return float(args.min_loss_scale), float(args.initial_loss_scale)


def _guarded(check, guard, args, run_metrics, *check_args) -> None:
    """Run one :class:`~.divergence.Guard` check; on a stop, rank 0 (``run_metrics`` given)
    records why in the metrics file before the stop propagates."""
    try:
        check(*check_args)
    except errors.TrainingStopped as stop:
        if run_metrics is not None:
            run_metrics.stopped = guard.record(stop)
            if args.metrics_out:
                run_metrics.write(args.metrics_out)
        raise


def _train(args, env, device) -> int:
    rank0 = env.rank == 0
    # --record-memory-history records from before the model is built, as Megatron-LM does
    snapshots = memory_snapshots.MemorySnapshots(args, device, env.rank, env.world_size)
    trainer = build_trainer(args, env, device)
    if rank0:
        security.warn_if_root()
        console.say(_describe_layout(args, device))
    model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.scheduler
    resume = checkpointing.Resume()
    if args.load:
        resume = checkpointing.load(args, model, optimizer, scheduler)
    if resume.iteration >= args.train_iters:
        if rank0:
            console.say(f" checkpoint is at iteration {resume.iteration}: nothing to train")
        return 0
    consumed = resume.iteration * args.global_batch_size
    iterators = data_mod.iterators(args, trainer.train_data, model, consumed)
    run_metrics = _run_metrics(args, device, trainer, resume, rank0)
    interval = metrics.IntervalLog()
    progress = (
        metrics.Progress(args.progress, args.train_iters, resume.iteration) if rank0 else None
    )
    for chunk in model:
        chunk.train()
    device.accelerator.reset_peak_memory_stats()
    on_host = device.torch_type == "cpu"
    host_step_peak: int | None = None  # set by the first step's probe on the host
    last_saved = resume.iteration
    floor, first_scale = _loss_scales(args)
    guard = divergence.Guard(
        args.divergence_steps, args.divergence_stop, min_loss_scale=floor, scale=first_scale
    )
    profiler = profiling.StepProfiler(args, device, env.rank)
    try:
        for step in range(resume.iteration + 1, args.train_iters + 1):
            # the host has no allocator statistics: its peak is measured on the first step
            # (a warm-up step, outside the s/step statistics) by the profiler, unless --profile
            # records that step (one profiler at a time): the run then has no host peak
            first = step == resume.iteration + 1 and step not in profiler.steps
            probe = host_peak.measure() if on_host and first else None
            profiler.starting(step)
            with probe or contextlib.nullcontext() as measured:
                start = _timed_sync(device)
                loss, grad_norm, lr, skipped = trainer.step(step, iterators)
                elapsed = _timed_sync(device) - start
            profiler.finished(step, elapsed)
            if measured is not None:
                host_step_peak = measured.peak_bytes
                run_metrics.profiled_step = step
            consumed += args.global_batch_size
            record = _step_record(args, trainer, step, (loss, grad_norm, lr, skipped), elapsed)
            if rank0:
                _report_step(args, run_metrics, interval, progress, record, consumed)
            if logged(args, step):
                snapshots.logged()
            _guarded(
                guard.after_step,
                guard,
                args,
                run_metrics if rank0 else None,
                step,
                loss,
                skipped,
                lr,
                record.loss_scale,
            )
            if args.save and args.save_interval and step % args.save_interval == 0:
                if guard.diverging:  # keep the last good checkpoint the latest
                    if rank0:
                        progress.print(f" not saving iteration {step}: its lm loss is NaN/inf")
                    continue
                _save(args, trainer, step, progress)
                last_saved = step
        _guarded(guard.at_end, guard, args, run_metrics if rank0 else None)
        if args.save and last_saved != args.train_iters:
            _save(args, trainer, args.train_iters, progress)
    finally:
        profiler.close()
        if progress is not None:
            progress.close()
    _finish(args, device, run_metrics, host_step_peak, rank0)
    return 0


def _run_metrics(args, device, trainer: Trainer, resume, rank0: bool) -> metrics.RunMetrics:
    """The run's metrics: its configuration, data and vocabulary, where it resumed from, and
    the FLOPs and peak its throughput is measured against; rank 0 says what it trains on."""
    train_data, vocab = trainer.train_data, trainer.vocab
    tokens_per_step = args.global_batch_size * args.seq_length
    run_metrics = metrics.RunMetrics(metrics.run_config(args, device), tokens_per_step)
    run_metrics.config["data"] = {
        "source": train_data.source,
        "description": train_data.description,
    }
    run_metrics.config["padded_vocab_size"] = vocab
    run_metrics.config["resumed_from"] = resume.loaded_from
    _set_throughput_basis(args, device, vocab, run_metrics, rank0)
    if rank0:
        console.say(
            f" data: {train_data.description} | padded vocab {vocab} | "
            f"training iterations {resume.iteration + 1}..{args.train_iters}"
        )
    return run_metrics


def _step_record(args, trainer: Trainer, step: int, outcome, elapsed: float) -> metrics.StepRecord:
    """One step's record from what the step returned (loss, grad norm, lr, skipped) and took."""
    loss, grad_norm, lr, skipped = outcome
    tokens_per_step = args.global_batch_size * args.seq_length
    aux = (
        moe_metrics.step_aux_losses(args.num_microbatches, args.num_layers)
        if args.num_experts is not None
        else None
    )
    return metrics.StepRecord(
        step=step,
        lm_loss=loss,
        grad_norm=grad_norm,
        lr=lr,
        loss_scale=float(trainer.optimizer.get_loss_scale().item()),
        skipped=skipped,
        step_time_s=elapsed,
        tokens_per_s=tokens_per_step / elapsed if elapsed > 0 else 0.0,
        params_norm=params_norm(trainer.model) if args.log_params_norm else None,
        moe_aux_losses=aux,
    )


def logged(args, step: int) -> bool:
    """Whether step ``step`` gets a log line: every ``--log-interval`` steps and the last."""
    return step % args.log_interval == 0 or step == args.train_iters


def _report_step(args, run_metrics, interval, progress, record, consumed: int) -> None:
    """Rank 0: the step into the metrics, its interval's log line when one is due (and the
    metrics file then), a skipped update's line, and the progress display."""
    step = record.step
    log_now = logged(args, step)
    run_metrics.add(record)
    interval.add(record)
    if log_now:
        progress.print(
            interval.line(args.train_iters, consumed, args.global_batch_size, run_metrics)
        )
        if args.metrics_out:
            run_metrics.write(args.metrics_out)
    if record.skipped:
        progress.print(
            f" iteration {step}: gradient overflow (inf/nan) -- update skipped, "
            f"loss scale now {record.loss_scale:.1f}"
        )
    progress.update(step, record.lm_loss, log_now)


def _save(args, trainer: Trainer, step: int, progress) -> None:
    checkpointing.save(args, trainer.model, trainer.optimizer, trainer.scheduler, step)
    if progress is not None:  # rank 0
        progress.print(f" saved checkpoint at iteration {step} to {args.save}")


def _mib(nbytes: int | None) -> str:
    return "not measured" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def _finish(args, device, run_metrics, host_step_peak: int | None, rank0: bool) -> None:
    """The run's peak memory over every rank (collective), then on rank 0 the summary: into the
    metrics file and the closing line. A host run where ``--profile`` recorded the first step
    of any rank has no allocator peak (None): the largest over the ranks is not known."""
    on_host = device.torch_type == "cpu"
    # [allocator peak, process peak RSS, 1 where this rank could not measure]: torch's allocator
    # statistics on an accelerator, the profiled step on the host (where max_memory_allocated
    # answers the resident set)
    unmeasured_here = int(on_host and host_step_peak is None)
    peaks = torch.tensor(
        [host_step_peak or 0, device.accelerator.max_memory_allocated(), unmeasured_here]
        if on_host
        else [device.accelerator.max_memory_allocated(), 0, 0],
        dtype=torch.int64,
        device=devices.current_torch_device(),
    )
    torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    if not rank0:
        return
    if peaks[2].item():  # some rank could not measure
        run_metrics.peak_memory_bytes, run_metrics.peak_memory_source = None, None
    else:
        run_metrics.peak_memory_bytes = int(peaks[0].item())
        run_metrics.peak_memory_source = (
            host_peak.SOURCE if on_host else f"torch.{device.torch_type}.max_memory_allocated"
        )
    run_metrics.peak_rss_bytes = int(peaks[1].item()) if on_host else None
    summary = run_metrics.summary()
    if args.metrics_out:
        run_metrics.write(args.metrics_out)
    console.say(
        f" done: {summary['steps']} steps | median {summary['median_step_time_s'] or 0:.3f} "
        f"s/step | {summary['tokens_per_s'] or 0:.0f} tokens/s | skipped "
        f"{summary['skipped_steps']} | {_throughput_note(summary)}peak allocated "
        f"{_mib(summary['peak_memory_bytes'])}{_rss_note(summary)}"
        f"{' | metrics: ' + args.metrics_out if args.metrics_out else ''}"
    )
