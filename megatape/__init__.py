"""The ``megatape`` command line, the views of compiled tapes, and measuring on a device.

    megatape.cli      every ``megatape`` subcommand (compile, run, viz, generate)
    megatape.views    pictures, traces and measured-profile views (matplotlib only for the pictures)
    megatape.measure  stream-copy bandwidth, step timing, the correctness check against the reference

The layers underneath, one way: ``opcodes`` <- ``schedule`` (compile time) <- ``interp`` (the
kernel and its runtime) <- ``megatape``. The benchmarks (``bench/``, ``python -m bench``) import
these; none of them imports ``bench`` (tests/test_wall.py).
"""
