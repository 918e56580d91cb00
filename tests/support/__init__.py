"""What tests in more than one folder share: the training-run fixtures (``training_runs``),
the recording CuPy stand-in (``cupy_api``), the GPU tests' gate (``gpu``), the fused-QKV
family fixtures (``hf_families``) and the GELU fusion tests' checks (``activation_fusions``).
tests/ is on ``sys.path`` under pytest, so this is ``support``."""
