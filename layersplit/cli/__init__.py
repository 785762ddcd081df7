"""The ``layersplit`` command line: argument parsing and printing only; the work is done by the
library packages it imports (never the reverse). :mod:`.app` holds the parser and ``main``; one
module per command family (``*_cmd``)."""

from layersplit.cli.app import main

__all__ = ["main"]
