"""The ``megatape`` command line and the views of compiled tapes.

    megatape.cli      every ``megatape`` subcommand (compile, run, viz, bench, bench-decoder)
    megatape.views    pictures, traces and measured-profile views (matplotlib only for the pictures)

The layers underneath, one way: ``opcodes`` <- ``schedule`` (compile time) <- ``interp`` (the
kernel and its runtime) <- ``bench`` and ``megatape``.
"""
