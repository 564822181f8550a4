"""`python -m autopar ...` runs the `autopar` command (see autopar/cli.py)."""
import sys

from autopar.cli import main

sys.exit(main())
