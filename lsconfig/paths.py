"""Where the shipped configs live, in a checkout and in an installed wheel.

A checkout keeps them in the repository's ``configs/`` (models, hardware, sweeps, ``monitor.yaml``);
the wheel carries the same files as package data, ``lsconfig/_configs/`` (``setup.py`` copies
``configs/`` there at build time), so a non-editable install finds them without the repository.
"""

from __future__ import annotations

from pathlib import Path

from lsconfig import envs

_HERE = Path(__file__).resolve().parent


def shipped_configs() -> Path:
    """The configs this install ships: the wheel's ``lsconfig/_configs/`` when present, else the
    checkout's ``configs/`` (an editable install or a source tree)."""
    packaged = _HERE / "_configs"
    return packaged if packaged.is_dir() else _HERE.parent / "configs"


def configs_root() -> Path:
    """``LAYERSPLIT_CONFIG_DIR`` if set (it must be an existing folder), else :func:`shipped_configs`."""
    return envs.config_dir() or shipped_configs()
