"""The built-in gradient definitions, one module per op family; importing registers them."""
from . import activations, math, nn, shape  # noqa: F401
