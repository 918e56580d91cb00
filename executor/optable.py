"""Print the supported-op table: ``python -m graphopt.executor.optable``."""

from .registry import supported_ops_markdown

if __name__ == "__main__":
    print(supported_ops_markdown(), end="")
