"""Builds graphopt under one import name from the repository's top-level layout.

setup.cfg maps the top-level folders ``rules/``, ``executor/`` and ``trainer/`` to the
packages ``graphopt.rules``, ``graphopt.executor`` and ``graphopt.trainer``; a package map
cannot place a single module, so this file places the top-level ``cli.py`` at
``graphopt/cli.py``. An editable install (``pip install -e .``) is made in setuptools'
strict mode, the one that follows this placement (its tree of links to the source files
needs a reinstall only when a module is added or removed).
"""
from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel


class BuildPyWithCli(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package == "graphopt":
            modules.append(("graphopt", "cli", "cli.py"))
        return modules


class StrictEditableWheel(editable_wheel):
    def finalize_options(self):
        # the lenient mode maps package folders only, so it would have no graphopt.cli
        if not self.mode:
            self.mode = "strict"
        super().finalize_options()


setup(cmdclass={"build_py": BuildPyWithCli, "editable_wheel": StrictEditableWheel})
