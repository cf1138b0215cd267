"""``python -m megatape ...``: the ``megatape`` command (megatape.cli)."""
import sys

from megatape.cli import main

sys.exit(main())
