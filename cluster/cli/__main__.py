"""`python -m cluster.cli ...`: what Ray jobs and sweeps run (no console script needed)."""
import sys

from cluster.cli.main import main

sys.exit(main())
