"""Benchmarks: the GPU driver (``megatape bench``) and the baselines it measures megatape against."""

#: where ``megatape bench`` / ``bench-decoder`` write unless ``--out`` says otherwise: the newest
#: result of each benchmark under a stable name (``llama70b-layer.json``, ``decoder-llama3.2-1b.json``)
RESULTS = "bench/results/latest"
