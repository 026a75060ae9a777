"""The package list, and the recipes shipped with it: the repository keeps ``recipes/`` (and ``recipes/tables/``) at
its top level, and the wheel carries them as package data at ``fedlight/recipes`` (a mapped package directory, no
copy and no symlink), where :mod:`fedlight.config.locate` finds them once installed. Everything else is in
pyproject.toml; tests, results and tools stay out of the wheel (only ``fedlight*`` packages are listed)."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["fedlight", "fedlight.*"]), "fedlight.recipes", "fedlight.recipes.tables"],
    package_dir={"fedlight.recipes": "recipes"},
    package_data={"fedlight.recipes": ["*.yaml", "README.md"], "fedlight.recipes.tables": ["*.yaml"]},
)
