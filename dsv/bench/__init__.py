"""Benchmarks: ``dsv bench kernels`` (sparse attention kernels against dense cuDNN and FlexAttention)."""
