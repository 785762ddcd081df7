"""``scripts/fresh_clone_check.sh`` and ``.ci/run`` replay the README's own commands, not copies that can
drift: the script reads them from the README (its ``--dry-run`` prints what it read), and CI's last line
is the README's test command."""

from __future__ import annotations

import re
import subprocess

from tests.readme_blocks import readme_lines
from tests.paths import ROOT





def test_script_reads_the_readme_commands():
    run = subprocess.run(["bash", str(ROOT / "scripts" / "fresh_clone_check.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    setup, tests = readme_lines("setup"), readme_lines("tests")
    assert run.stdout.splitlines() == [f"install: {setup[0]}", f"main job: {setup[1]}", f"tests: {tests[0]}"]
    assert "pip install" in setup[0] and "layersplit" in setup[1] and "pytest" in tests[0]


def test_ci_runs_exactly_the_readme_test_command():
    lines = [ln for ln in ROOT.joinpath(".ci", "run").read_text().splitlines() if ln.strip()]
    (command,) = readme_lines("tests")
    assert lines[-1] == command
    assert re.search(r"pip install .*-e \"\.\[dev\]\"", ROOT.joinpath(".ci", "run").read_text())
