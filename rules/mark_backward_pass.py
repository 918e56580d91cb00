"""Every node of the backward pass gets __backwardpass=1: the com.microsoft YieldOp and every
node that is not an ancestor of it (ONNX Runtime's RocmBlasAltImpl, without depending on
node order). The executor runs these nodes under the BackwardPassGuard."""
from __future__ import annotations

import onnx

from graphopt.dsl import Pass
from graphopt.errors import GraphoptError
from graphopt.ir import MS_DOMAIN, STANDARD_DOMAIN, nested_nodes, subgraphs_of
from graphopt.vocabulary import BACKWARD_PASS_ATTRIBUTE, YIELD_OP, is_yield_op


def forward_nodes(graph, yield_id: int) -> set[int]:
    """YieldOp's ancestors: the nodes whose results the forward outputs depend on."""
    ancestors: set[int] = set()
    stack = [yield_id]
    while stack:
        node_id = stack.pop()
        for name in (*graph.inputs_of(node_id), *graph.implicit_inputs(node_id)):
            producer = graph.producer_of(name)
            if producer is not None and producer not in ancestors:
                ancestors.add(producer)
                stack.append(producer)
    return ancestors


def mark(graph, report) -> int:
    if graph is not graph.model.graph:
        return 0  # the main graph's run counts (and refuses) the YieldOps of every branch
    yields = graph.nodes_of_type(YIELD_OP, MS_DOMAIN)
    nested = [node for owner in graph.subgraph_owner_ids()
              for body in subgraphs_of(graph.node(owner)) for node, _ in nested_nodes(body)
              if is_yield_op(node)]
    if not yields and not nested:
        return 0
    if len(yields) + len(nested) > 1 or nested:
        names = ", ".join([repr(graph.name_of(i)) for i in yields]
                          + [repr(n.name) for n in nested])
        where = f", {len(nested)} inside an If/Loop/Scan body" if nested else ""
        raise GraphoptError(f"the graph has {len(yields) + len(nested)} YieldOp nodes "
                            f"({names}){where}; a training graph has exactly one, "
                            "in its main graph")
    forward = forward_nodes(graph, yields[0])
    changes = 0
    for node_id in graph.sorted_ids():
        if graph.op_key(node_id) == (STANDARD_DOMAIN, "Constant"):
            # A Constant computes nothing (no GEMM/conv to guard), and ONNX reads a Constant
            # with a second attribute wrongly: shape inference took __backwardpass=1 as its
            # value, the whole-model check failed and the pass was rolled back entirely.
            continue
        marked = graph.attr(node_id, BACKWARD_PASS_ATTRIBUTE) == 1
        if node_id in forward and marked:
            graph.set_attribute(node_id, onnx.helper.make_attribute(BACKWARD_PASS_ATTRIBUTE, 0))
            changes += 1
        elif node_id not in forward and not marked:
            graph.set_attribute(node_id, onnx.helper.make_attribute(BACKWARD_PASS_ATTRIBUTE, 1))
            changes += 1
    return changes


PASS = Pass(
    name="mark_backward_pass",
    description="YieldOp and every node after it get __backwardpass=1 (FP16 alt GEMM/conv)",
    level=1,
    tags=("training", "rocm"),
    run=mark,
)
