"""``python -m zmlcore.sim``: run simulated nodes (same as ``zml sim``)."""

import sys

from zmlcore.sim.cli import main

sys.exit(main())
