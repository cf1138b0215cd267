"""Benchmarks: the GPU driver (``megatape bench``) and the baselines it measures megatape against."""
