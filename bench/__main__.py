"""``python -m bench COMMAND``: the lab's command line (bench/cli.py)."""
import sys

from bench.cli import main

sys.exit(main())
