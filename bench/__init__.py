"""Benchmarks (the lab): ``python -m bench layer`` and ``python -m bench decoder`` (bench/cli.py), the
baselines megatape is measured against, probes. The lab imports the product (opcodes, schedule,
interp, megatape); the product never imports the lab (tests/test_wall.py)."""

#: where ``python -m bench layer`` / ``decoder`` write unless ``--out`` says otherwise: the newest
#: result of each benchmark under a stable name (``llama70b-layer.json``, ``decoder-llama3.2-1b.json``)
RESULTS = "bench/results/latest"
