"""Save the seed loop's GPT model as initialised, before any step, through the seed's own functions.

Run under ``torchrun --nproc-per-node 2 save_initial_model.py DIR`` next to the seed script; the
seed-example test compares this checkpoint with the trained one to see every parameter move.
"""

import sys

import run_simple_mcore_train_loop as seed  # its one added line applies megatron-npu
import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

if __name__ == "__main__":
    seed.initialize_distributed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)
    model = seed.model_provider()
    model.to(torch.device("cuda"))
    seed.save_distributed_checkpoint(checkpoint_path=sys.argv[1], gpt_model=model)
