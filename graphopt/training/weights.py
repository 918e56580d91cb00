"""A model with new values for some of its initializers: what training writes back."""
from __future__ import annotations

import numpy as np
import onnx


def with_weights(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` (its graph as it is) in which each initializer named in ``values``
    holds that value, cast to the initializer's own dtype (float32 master weights go back
    into a float16 model as float16). Each new value is encoded once, straight into the
    copy's tensor (a loaded model's large weights are references: copying them is cheap)."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    for tensor in proto.graph.initializer:
        if tensor.name not in values:
            continue
        name, data_type = tensor.name, tensor.data_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(data_type)
        value = np.asarray(values[name]).astype(dtype, copy=False)
        tensor.Clear()
        tensor.name, tensor.data_type = name, data_type
        tensor.dims.extend(value.shape)
        tensor.raw_data = value.tobytes()   # C order, whatever the array's layout
    return proto
