"""``python -m tenplex_jax.wsp --job MODULE:FUNCTION --name NAME --devices K --stores ...``: a
virtual worker in a process of its own (what ``tj.wsp.Processes`` starts)."""

import sys

from tenplex_jax._src.wsp.process import main

if __name__ == "__main__":
    sys.exit(main())
