"""A model with new values for some of its initializers: what training writes back."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper


def with_weights(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` (its graph as it is) in which each initializer named in ``values``
    holds that value, cast to the initializer's own dtype (float32 master weights go back
    into a float16 model as float16)."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    for index, tensor in enumerate(proto.graph.initializer):
        if tensor.name in values:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            replacement = numpy_helper.from_array(values[tensor.name].astype(dtype), tensor.name)
            proto.graph.initializer[index].CopyFrom(replacement)
    return proto
