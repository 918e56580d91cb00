"""Kernel families. Importing this package registers every kernel in executor.registry."""

from . import (  # noqa: F401
    aten,
    contrib,
    conv,
    elementwise,
    gather,
    linalg,
    loss,
    nn,
    reduce,
    shape,
    training_ops,
)
