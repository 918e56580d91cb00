"""Identity nodes -> gone (their readers read the input), as ONNX Runtime's level-1
EliminateIdentity does: exporters and gradient builders leave Identities between a MatMul
and the Mul that scales it, which hides the pair from the FusedMatMul fusions.

A graph output keeps its name: when the Identity's output is a graph output, the node that
produces the Identity's input writes the output name directly instead (if that input is
itself neither a graph input, an initializer nor a graph output); otherwise the Identity stays.
"""
from __future__ import annotations

from graphopt.dsl import Pass


def _remove(graph, node_id: int) -> bool:
    source, target = graph.inputs_of(node_id)[0], graph.outputs_of(node_id)[0]
    # A subgraph reading a name from the outer scope would need editing too to follow a
    # rename: Identities whose input or output one reads stay. (Identity's one input and
    # output are required: a model with an empty one is refused on load.)
    if graph.read_by_subgraph(target):
        return False
    if not graph.is_output(target):
        graph.remove_node(node_id)
        graph.redirect_readers(target, source)
        return True
    # The output name must survive: the producer of the input writes it instead (a graph
    # input or an initializer has no producer; a graph output keeps its own name)
    producer = graph.producer_of(source)
    if producer is None or graph.is_output(source) or graph.read_by_subgraph(source):
        return False
    graph.remove_node(node_id)
    order = graph.order_of(producer)
    renamed = graph.new_node(graph.node(producer))
    outputs = [target if name == source else name for name in renamed.output]
    del renamed.output[:]
    renamed.output.extend(outputs)
    graph.remove_node(producer)
    graph.add_node(renamed, order)
    graph.redirect_readers(source, target)   # (the graph output keeps its declared type)
    return True


def remove(graph, report) -> int:
    removed = 0
    for node_id in sorted(graph.nodes_of_type("Identity"), key=graph.order_of):
        removed += _remove(graph, node_id)
    return removed


PASS = Pass(
    name="remove_identity",
    description="Identity nodes removed (readers read the input; graph output names kept)",
    level=1,
    tags=("cleanup",),
    run=remove,
)
