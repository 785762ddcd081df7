"""``scripts/fresh_clone_check.sh`` and ``.ci/run`` replay the README's own commands, not copies that can
drift: the script reads them from the README (its ``--dry-run`` prints what it read), and CI's last line
is the README's test command."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bash_block(heading: str) -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split(f"\n{heading}", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_script_reads_the_readme_commands():
    run = subprocess.run(["bash", str(ROOT / "scripts" / "fresh_clone_check.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    setup, tests = _bash_block("## Set up and run"), _bash_block("## Test")
    assert run.stdout.splitlines() == [f"install: {setup[0]}", f"main job: {setup[1]}", f"tests: {tests[0]}"]
    assert "pip install" in setup[0] and "layersplit" in setup[1] and "pytest" in tests[0]


def test_ci_runs_exactly_the_readme_test_command():
    lines = [ln for ln in ROOT.joinpath(".ci", "run").read_text().splitlines() if ln.strip()]
    (command,) = _bash_block("## Test")
    assert lines[-1] == command
    assert re.search(r"pip install .*-e \"\.\[dev\]\"", ROOT.joinpath(".ci", "run").read_text())
