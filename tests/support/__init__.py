"""What tests in more than one folder share: the training-run fixtures (``training_runs``),
the recording CuPy stand-in (``cupy_api``), the GPU tests' gate (``gpu``) and the fused-QKV
family fixtures (``hf_families``). tests/ is on ``sys.path`` under pytest, so this is
``support``."""
