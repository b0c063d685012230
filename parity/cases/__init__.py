"""Parity cases, one module per patch area; registry entries point here by name."""
