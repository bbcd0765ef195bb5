"""``python -m engine COMMAND``: serve a model, run the simulator, or write a random model."""

from __future__ import annotations

import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
