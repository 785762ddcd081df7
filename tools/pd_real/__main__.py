"""``python -m tools.pd_real storm|probes ...``: the PD abort protocol on real processes (see :mod:`tools.pd_real.cli`)."""

import sys

from tools.pd_real.cli import main

sys.exit(main())
