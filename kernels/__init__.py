"""Triton kernels and their torch references (imported as ``baton.kernels``)."""
