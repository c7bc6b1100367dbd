"""``python -m tenplex_jax``: the same command line as the ``tenplex-jax`` console script."""

import sys

from tenplex_jax._src.cli import main

if __name__ == "__main__":
    sys.exit(main())
