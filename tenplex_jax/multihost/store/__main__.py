"""``python -m tenplex_jax.multihost.store --dir DIR [--port 0] [--ready-file F]``: run a store
server."""

import sys

from tenplex_jax._src.multihost.store.server import main

sys.exit(main())
