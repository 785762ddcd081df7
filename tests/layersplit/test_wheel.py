"""The built wheel is a working install on its own: it carries ``configs/`` (models, hardware, sweeps,
``monitor.yaml``) and, imported from a plain ``--target`` folder outside the repository, runs ``plan``,
``sweep --engine model`` and the spec monitor's default config load (issue 29, item 5)."""

from __future__ import annotations

import pytest

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.paths import ROOT

PACKAGES = ("dsa_kernels", "hicache", "layersplit", "lsconfig")
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "configs", "tools", "tests", *PACKAGES)

# run from the wheel's folder: every import must come from it, never from the checkout
CHECK = """
import json, sys
from pathlib import Path
import layersplit, lsconfig.paths
site = Path(sys.argv[1]).resolve()
assert Path(layersplit.__file__).resolve().is_relative_to(site), layersplit.__file__
assert lsconfig.paths.shipped_configs().is_relative_to(site), lsconfig.paths.shipped_configs()
from layersplit.pd.spec.monitor_config import load_monitor_config
cfg = load_monitor_config()
print(json.dumps({"layersplit": layersplit.__file__, "monitor_threshold": str(cfg.garbled.threshold)}))
"""


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
    src.mkdir()
    for name in SOURCES:
        item = ROOT / name
        if item.is_dir():
            shutil.copytree(item, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(item, src / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = dist.glob("layersplit-*.whl")
    return wheel


def _run(args: list[str], cwd: Path, site: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSPLIT_")}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_wheel_ships_configs_and_runs_outside_the_repo(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == set(PACKAGES), top  # the card's packages and their shared config: no tools, no tests
    shipped = sorted(p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml"))
    assert shipped and [n for n in shipped if f"lsconfig/_configs/{n}" not in names] == []
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, timeout=300, capture_output=True)

    plan = _run(["-m", "layersplit", "plan", "--model", "glm-5", "--cp", "8", "--hardware", "h200", "--json"],
                elsewhere, site)
    assert plan.returncode == 0, plan.stderr
    from layersplit.api import plan_capacity  # the checkout's answer: the wheel must give the same

    assert json.loads(plan.stdout) == json.loads(json.dumps(plan_capacity("glm-5", "h200", cp=8)))

    out = elsewhere / "sweep"
    sweep = _run(["-m", "layersplit", "sweep", "--engine", "model", "--out", str(out)], elsewhere, site)
    assert sweep.returncode == 0, sweep.stderr
    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    assert points and (out / "table.md").is_file()

    check = _run(["-c", CHECK, str(site)], elsewhere, site)
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["monitor_threshold"] == "7/5"
