"""Builds graphopt under one import name from the repository's top-level layout.

setup.cfg maps the top-level folders ``rules/``, ``executor/`` and ``trainer/`` to the
packages ``graphopt.rules``, ``graphopt.executor`` and ``graphopt.trainer``; a package map
cannot place a single module, so this file places the top-level ``cli.py`` at
``graphopt/cli.py``. Nothing else is customised.
"""
from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithCli(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package == "graphopt":
            modules.append(("graphopt", "cli", "cli.py"))
        return modules


setup(cmdclass={"build_py": BuildPyWithCli})
