import sys

from layersplit.cli import main

sys.exit(main())
