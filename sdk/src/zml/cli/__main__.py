"""Allows `python -m zml.cli`."""
import sys

from zml.cli import main

sys.exit(main())
