"""Where the checkout is, for tests that run a script, a module of ``tools/`` or a build from it."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
