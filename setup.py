"""Package discovery: `autopar` and every subpackage under it, plus the top-level `passes/` and
`costmodel/` folders installed as `autopar.passes` and `autopar.costmodel` (DESIGN.md's layout).
Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

FOLDERS = {"autopar": "autopar", "autopar.passes": "passes", "autopar.costmodel": "costmodel"}

packages = [f"{name}.{sub}" if sub else name
            for name, folder in FOLDERS.items() for sub in ["", *find_packages(folder)]]
setup(packages=packages, package_dir=FOLDERS)
