"""Stand-in for the one Megatron-LM module the user-guide loop imports (see tokenizer.py)."""
