"""Triton kernels (loaded lazily: importing compiled_moe needs no Triton)."""
