"""``python -m graphopt`` is the ``graphopt`` command."""
from graphopt.console import main

main()
