"""`python -m gflow`: the command line lives in gflow/tools/cli.py."""

import sys

from gflow.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
