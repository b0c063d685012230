"""The Megatron Core user guide's training loop, run as a user would (see test_seed_example.py)."""
