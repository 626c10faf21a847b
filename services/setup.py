"""The `services` package is this directory: setuptools maps it here and lists its subpackages
(pyproject.toml cannot spell a package rooted at the project directory itself)."""

from setuptools import find_packages, setup

setup(
    package_dir={"services": "."},
    packages=["services", *(f"services.{name}" for name in find_packages(exclude=["build*"]))],
)
