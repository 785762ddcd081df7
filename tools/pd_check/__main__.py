"""``python -m tools.pd_check [flags]``: the PD abort protocol's model checker (see :mod:`tools.pd_check.cli`)."""

import sys

from tools.pd_check.cli import main

sys.exit(main())
