"""Build hook: the wheel carries the repository's ``configs/`` (models, hardware, sweeps, monitor.yaml) as
package data ``lsconfig/_configs/``, where :func:`lsconfig.paths.shipped_configs` finds it once installed.
The repository keeps ``configs/`` where it is (the README and the tests name it); everything else about
the package is in ``pyproject.toml``."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONFIGS = Path(__file__).resolve().parent / "configs"


class BuildPyWithConfigs(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's configs/ in place
            return
        target = Path(self.build_lib) / "lsconfig" / "_configs"
        for src in sorted(CONFIGS.rglob("*.yaml")):
            dest = target / src.relative_to(CONFIGS)
            self.mkpath(str(dest.parent))
            self.copy_file(str(src), str(dest))


setup(cmdclass={"build_py": BuildPyWithConfigs})
