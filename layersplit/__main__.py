import sys

from layersplit.cli.app import main

sys.exit(main())
