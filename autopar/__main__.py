"""`python -m autopar ...` runs the `autopar` command (see autopar/inspection/cli.py)."""
import sys

from autopar.inspection.cli import main

sys.exit(main())
