"""The seeds' Megatron-Core user-guide loop, run as a user would (see test_seed_example.py)."""
