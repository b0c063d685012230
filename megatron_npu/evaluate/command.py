"""``megatron-npu evaluate --task lambada --load CKPT --valid-data FILE [--strict-lambada]``.

Zero-shot LAMBADA accuracy of a ``megatron-npu train`` checkpoint (Megatron-LM's
``tasks/zeroshot_gpt`` semantics: :mod:`.lambada`). The model is described with train's own
options (the same ``--num-layers/--hidden-size/...`` the run used; training-only options such as
``--train-iters``/``--lr`` may be left out) and may be laid out in any TP/PP(/DP) layout
(``--nproc-per-node N --tensor-model-parallel-size T --pipeline-model-parallel-size P``): the
checkpoint is resharded on load. ``--valid-data default`` (the default) is the shipped cloze set
built from the embedded corpus; the tokenizer is train's (byte-level for the default corpus, else
``--tokenizer-type`` and its files).

Vocabulary-parallel logits are never gathered: each TP rank takes its shard's maximum and the
first rank holding the overall maximum wins, which is exactly ``argmax`` over the full row (ties
go to the lowest index). Every data-parallel replica evaluates every passage.

Prints Megatron-LM's result line and, with ``--results-out F``, writes
``{"task", "accuracy", "correct", "n", "strict", "target_nll", "truncated", "data", "load",
"iteration", "layout"}`` to ``F`` (``target_nll``: mean negative log-likelihood of the target
tokens, a finer figure than the accuracy). Exit 0; 2 on bad options or data.
"""

from __future__ import annotations

import copy
import os
from functools import partial
from typing import TYPE_CHECKING

from megatron_npu import console

if TYPE_CHECKING:
    from megatron_npu.formats.lambada_result import LambadaResult


def main(argv: list[str]) -> int:
    from megatron_npu.evaluate.lambada import LambadaDataError, read_passages
    from megatron_npu.training import arguments, launch, quiet_expected_warnings, security

    security.set_umask()
    quiet_expected_warnings()
    if "-h" in argv or "--help" in argv:
        arguments.build_parser("evaluate").print_help()
        console.say(__doc__)
        return 0
    try:
        args = arguments.parse_args(list(argv), command="evaluate")
    except SystemExit as exc:
        return int(exc.code or 2)
    if not args.load:
        console.error("megatron-npu evaluate: error: --load CKPT is required")
        return 2
    try:
        read_passages(args.valid_data)  # fail fast, before any rank starts
    except LambadaDataError as exc:
        console.error(f"megatron-npu evaluate: error: {exc}")
        return 2
    if args.nproc_per_node is not None and "RANK" not in os.environ:
        try:
            arguments.finalize(copy.copy(args), args.nproc_per_node * args.nnodes)
        except arguments.ArgumentError as exc:
            console.error(f"megatron-npu evaluate: error: {exc}")
            return 2
        return launch.launch(list(argv), args, module="megatron_npu.evaluate.worker")
    return worker_main(launch.strip_launch_options(list(argv)))


def worker_main(argv: list[str]) -> int:
    """One rank of an evaluation (what the launcher starts)."""
    from megatron_npu.patches import jit_fusions
    from megatron_npu.training import arguments, errors, launch, quiet_expected_warnings

    quiet_expected_warnings()
    args = arguments.parse_args(list(argv), command="evaluate")
    jit_fusions.load_eagerly(args.device)
    from megatron_npu.training.rank_session import rank_session

    args.no_load_optim = args.no_load_rng = True
    env = launch.dist_env(args.master_addr, args.master_port)
    try:
        with rank_session(args, env) as device:
            result = _evaluate(args, env, device)
    except errors.TrainingInputError as exc:  # options, a checkpoint that does not load, ...:
        return errors.report(exc, "evaluate")  # one line, said once by the launcher
    if result is not None and args.results_out:
        result.write(args.results_out)
    return 0


def _tokenizer(args):
    from megatron_npu.data.tokenizers import ByteLevelTokenizer, build_tokenizer

    if args.mock_data:
        raise ValueError("evaluate needs a text tokenizer: --mock-data runs have none")
    if args.data_path:
        return build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
    return ByteLevelTokenizer()


def vocab_parallel_argmax(logits, group):
    """``argmax(-1)`` over a vocabulary split across ``group`` (first maximum wins)."""
    import torch
    from megatron.core import parallel_state

    local_max, local_idx = logits.float().max(dim=-1)
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return local_idx
    rank = parallel_state.get_tensor_model_parallel_rank()
    offset = rank * logits.shape[-1]
    maxes = [torch.empty_like(local_max) for _ in range(size)]
    idxs = [torch.empty_like(local_idx) for _ in range(size)]
    torch.distributed.all_gather(maxes, local_max.contiguous(), group=group)
    torch.distributed.all_gather(idxs, (local_idx + offset).contiguous(), group=group)
    winner = torch.stack(maxes).argmax(dim=0, keepdim=True)
    return torch.stack(idxs).gather(0, winner).squeeze(0)


def _evaluate(args, env, device) -> LambadaResult | None:
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_npu.evaluate.lambada import build_samples, read_passages
    from megatron_npu.training import arguments, checkpointing, launch, loop
    from megatron_npu.training import model as model_mod
    from megatron_npu.training import optimizer as optim_mod

    arguments.finalize(args, env.world_size)
    launch.init_model_parallel(args)
    loop.set_seeds(args.seed)
    tokenizer = _tokenizer(args)
    vocab = model_mod.padded_vocab_size(int(tokenizer.vocab_size), args)
    args.padded_vocab_size = vocab
    model, config = model_mod.build(args, device, vocab, env.local_rank)
    optimizer, scheduler = optim_mod.build(args, model)
    resume = checkpointing.load(args, model, optimizer, scheduler)
    if resume.loaded_from is None:
        raise arguments.ArgumentError(f"--load {args.load}: no checkpoint found there")
    config.grad_scale_func = None
    config.finalize_model_grads_func = None
    for chunk in model:
        chunk.eval()
    passages = read_passages(args.valid_data)
    samples = build_samples(passages, tokenizer, args.seq_length, args.strict_lambada)
    mbs = args.micro_batch_size
    padded = samples + [samples[-1]] * ((-len(samples)) % mbs)
    valid = [1] * len(samples) + [0] * (len(padded) - len(samples))
    tp_group = parallel_state.get_tensor_model_parallel_group()
    torch_device = device.torch_device(None if device.torch_type == "cpu" else env.local_rank)

    def batches():
        for start in range(0, len(padded), mbs):
            chunk = padded[start : start + mbs]
            text = torch.tensor([s.tokens for s in chunk], dtype=torch.long)
            tokens = text[:, :-1]
            seq = tokens.shape[1]
            yield {
                "tokens": tokens,
                "labels": text[:, 1:],
                "mask": torch.tensor([s.mask for s in chunk], dtype=torch.long),
                "valid": torch.tensor(valid[start : start + mbs], dtype=torch.long),
                "position_ids": torch.arange(seq).unsqueeze(0).expand(len(chunk), seq),
                "attention_mask": torch.tril(torch.ones(1, 1, seq, seq)).lt(0.5),
            }

    def score(batch, logits):
        predicted = vocab_parallel_argmax(logits, tp_group)
        labels = batch["labels"].to(predicted.device)
        mask = batch["mask"].to(predicted.device).bool()
        valid_rows = batch["valid"].to(predicted.device)
        correct = ((predicted == labels) | ~mask).all(dim=-1).long() * valid_rows
        nll = vocab_parallel_cross_entropy(
            logits.transpose(0, 1).float().contiguous(), labels.transpose(0, 1).contiguous()
        ).transpose(0, 1)
        scored = mask & valid_rows.bool().unsqueeze(-1)
        counts = torch.stack(
            [
                correct.sum().double(),
                valid_rows.sum().double(),
                nll[scored].double().sum(),
                scored.sum().double(),
            ]
        )
        return torch.zeros((), device=logits.device), {"lambada": counts.cpu()}

    def forward_step(data_iterator, chunk):
        gpt = model_mod.unwrap(chunk)
        batch = next(data_iterator)
        tokens = batch["tokens"].to(torch_device) if gpt.pre_process else None
        positions = batch["position_ids"].to(torch_device) if gpt.pre_process else None
        logits = chunk(tokens, positions, batch["attention_mask"].to(torch_device))
        return logits, partial(score, batch)

    iterators = [
        batches() if model_mod.unwrap(c).pre_process or model_mod.unwrap(c).post_process else None
        for c in model
    ]
    forward_backward = get_forward_backward_func()
    store: list[dict] = []
    with torch.no_grad():
        for _ in range(len(padded) // mbs):
            store += (
                forward_backward(
                    forward_step_func=forward_step,
                    data_iterator=iterators if len(iterators) > 1 else iterators[0],
                    model=model if len(model) > 1 else model[0],
                    num_microbatches=1,
                    seq_length=args.seq_length,
                    micro_batch_size=mbs,
                    decoder_seq_length=args.seq_length,
                    forward_only=True,
                )
                or []
            )
    owner = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    local = torch.zeros(4, dtype=torch.float64)
    if owner and store:
        local = torch.stack([d["lambada"] for d in store]).sum(dim=0)
    total = local.to(devices_current())
    torch.distributed.all_reduce(total)
    correct, n, nll_sum, target_tokens = total.cpu().tolist()
    correct, n = int(correct), int(n)
    if env.rank != 0:
        return None
    accuracy = correct / n if n else 0.0
    from megatron_npu.evaluate.lambada import SET_TITLES, set_name
    from megatron_npu.formats.lambada_result import LambadaResult

    line = (
        f" validation results on {SET_TITLES[set_name(args.valid_data)]}"
        f"{' (strict)' if args.strict_lambada else ''} | number correct: "
        f"{correct:.4E} | total examples: {n:.4E} | avg accuracy: {accuracy:.4E}"
    )
    console.say("-" * (len(line) + 1) + "\n" + line + "\n" + "-" * (len(line) + 1))
    return LambadaResult(
        task="lambada",
        set=set_name(args.valid_data),
        accuracy=accuracy,
        correct=correct,
        n=n,
        strict=bool(args.strict_lambada),
        target_nll=nll_sum / target_tokens if target_tokens else None,
        truncated=sum(1 for s in samples if s.truncated),
        data=str(args.valid_data),
        load=resume.loaded_from,
        iteration=resume.iteration,
        layout=checkpointing._layout(args),
    )


def devices_current():
    from megatron_npu import devices

    return devices.current_torch_device()
