"""``python -m engine.sim --port P ...``: run the SIMULATED engine without the ``kvgate`` console script."""

from __future__ import annotations

import sys

from engine.sim.cli import sim_engine_main

if __name__ == "__main__":
    sys.exit(sim_engine_main())
