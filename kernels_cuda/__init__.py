"""Triton kernels for the CUDA backend, one op family per file."""
