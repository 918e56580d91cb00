"""Identity nodes -> gone (their readers read the input), as ONNX Runtime's level-1
EliminateIdentity does: exporters and gradient builders leave Identities between a MatMul
and the Mul that scales it, which hides the pair from the FusedMatMul fusions.

A graph output keeps its name: when the Identity's output is a graph output, the node that
produces the Identity's input writes the output name directly instead (if that input is
itself neither a graph input, an initializer nor a graph output); otherwise the Identity stays.
"""
from __future__ import annotations

from graphopt.dsl import Pass


def _read_by_a_subgraph(graph, tensor: str) -> bool:
    """A subgraph reads ``tensor`` by name from the outer scope: renaming it would need the
    subgraph edited too, so such Identities stay."""
    return any(tensor in graph._implicit.get(user, ()) for user in graph.consumers_of(tensor))


def _rewire_readers(graph, old: str, new: str) -> None:
    for user in graph.consumers_of(old):
        for index, name in enumerate(graph.node_inputs[user]):
            if name == old:
                graph.replace_input(user, index, new)


def _remove(graph, node_id: int) -> bool:
    source, target = graph.node_inputs[node_id][0], graph.node_outputs[node_id][0]
    if not source or not target or _read_by_a_subgraph(graph, target):
        return False
    if not graph.is_output(target):
        graph.remove_node(node_id)
        _rewire_readers(graph, target, source)
        return True
    # The output name must survive: the producer of the input writes it instead.
    producer = graph.producer.get(source)
    if (producer is None or graph.is_output(source) or graph.is_graph_input(source)
            or source in graph.initializers or _read_by_a_subgraph(graph, source)):
        return False
    graph.remove_node(node_id)
    order = graph.order[producer]
    renamed = graph.new_node(graph.node(producer))
    outputs = [target if name == source else name for name in renamed.output]
    del renamed.output[:]
    renamed.output.extend(outputs)
    graph.remove_node(producer)
    graph.add_node(renamed, order)
    _rewire_readers(graph, source, target)
    if source in graph.types and target not in graph.types:
        graph.set_type(target, graph.types[source])
    return True


def remove(graph, report) -> int:
    removed = 0
    for node_id in sorted(graph.nodes_of_type("Identity"), key=graph.order.__getitem__):
        removed += _remove(graph, node_id)
    return removed


PASS = Pass(
    name="remove_identity",
    description="Identity nodes removed (readers read the input; graph output names kept)",
    level=1,
    tags=("cleanup",),
    run=remove,
)
