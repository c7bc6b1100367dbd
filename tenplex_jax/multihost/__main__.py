"""``python -m tenplex_jax.multihost SCRIPT ARGS``: a process of a launched job (the launcher's
entry point for every worker): join ``jax.distributed``, then run SCRIPT as ``__main__``."""

import sys

from tenplex_jax._src.multihost.launched import main

if __name__ == "__main__":
    sys.exit(main())
