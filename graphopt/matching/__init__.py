"""Pattern matching, one module per job:

- ``codegen``: the one matcher semantics (each pattern feature's check and the reason it
  fails), emitted as the engine's fast matcher and as the matcher --explain runs;
- ``compiled``: a rule's pattern compiled (anchors, both matchers, fan-outs);
- ``misses``: why a pattern did not match, built lazily;
- ``views``: what rules see of a match (Match, NodeView, TensorView).
"""
from .compiled import CompiledPattern, compiled_pattern
from .misses import Miss
from .views import Match, NodeView, TensorView, bound_tensor

__all__ = ["CompiledPattern", "compiled_pattern", "Match", "Miss", "NodeView", "TensorView",
           "bound_tensor"]
