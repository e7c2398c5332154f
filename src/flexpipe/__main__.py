"""``python -m flexpipe``: the same command line as the ``flexpipe`` console script."""

import sys

from flexpipe.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
