"""The test suite's root: pytest puts this folder on sys.path, so the shared helpers are
importable as ``support.*`` (``support.models``: tiny models from ONNX text, the committed
fixtures, onnxruntime as an oracle)."""
