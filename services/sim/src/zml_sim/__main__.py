"""``python -m zml_sim``: run simulated nodes (same as ``zml sim``)."""

import sys

from zml_sim.cli import main

sys.exit(main())
