"""Inline weights as references into the model file: read a model without its weights' bytes,
write it back with them streamed from the file.

A model exported with its weights inline (PyTorch's TorchScript exporter writes them so, up to
2 GB) is mostly bytes no rewrite reads: a 118M-parameter model is 470 MB of ``raw_data`` and
under 1 MB of graph. Parsing it whole, every whole-model step (inference, checks, the journal's
snapshot, the save) pays for the weights again. So :func:`read_without_weights` walks the
protobuf wire format of the file (mapped, not read) and hands the parser the model with each
large main-graph initializer's ``raw_data`` left out, the tensor marked as ONNX external data
whose location is the model file itself and whose offset is where its bytes lie in it. To
everything else in graphopt such a tensor is an external tensor like any other: its value is
read from the open model file when a rule needs it (:class:`graphopt.modelio.ExternalFiles`),
and the training run reads them all.

:func:`write_with_weights` writes the model back inline: the protobuf encoding of the model
with every such tensor's bytes copied from the input file in place of its reference, streamed
(the graph is encoded piece by piece; a weight is never in memory whole). The bytes written are
the ones ``SerializeToString`` gives for the model with the weights inline: protobuf encodes a
message as its fields in field-number order, so a message is the encoding of its fields before
the one spliced in, that field, and the fields after it.

Only what the wire format makes unambiguous is referenced: a main-graph initializer with one
``raw_data`` field of at least :data:`MIN_REFERENCED_BYTES`, no external-data fields and no
unknown fields. Anything the scan does not understand (a group, a field running past its
message) makes it give up, and the caller parses the file as it is (and reports it broken).
"""
from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator

import onnx

# Tensors smaller than this stay in the proto: shape-like vectors, scales, biases. (Shape
# inference reads small integer tensors' values; these are far below this size.)
MIN_REFERENCED_BYTES = 1 << 16

_LEN = 2
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9
_TENSOR_EXTERNAL_FIELDS = (13, 14)  # external_data, data_location


class _Unreadable(Exception):
    """The bytes are not a protobuf message this scan understands."""


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= end or shift > 63:
            raise _Unreadable
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, payload start, field end) of each field of the
    message in ``buf[start:end]``."""
    pos = start
    while pos < end:
        key, payload = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Unreadable
        if wire == 0:
            _, stop = _varint(buf, payload, end)
        elif wire == 1:
            stop = payload + 8
        elif wire == 5:
            stop = payload + 4
        elif wire == _LEN:
            length, payload = _varint(buf, payload, end)
            stop = payload + length
        else:  # groups: not in ONNX's schema
            raise _Unreadable
        if stop > end:
            raise _Unreadable
        yield number, wire, pos, payload, stop
        pos = stop


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(number: int, payload_length: int) -> bytes:
    """The key and length of a length-delimited field (its payload follows)."""
    return encode_varint(number << 3 | _LEN) + encode_varint(payload_length)


def read_without_weights(fd: int, size: int, location: str, *,
                         min_bytes: int = MIN_REFERENCED_BYTES) -> onnx.ModelProto | None:
    """The model in the open file ``fd`` (``size`` bytes) with its main-graph weights of at
    least ``min_bytes`` as references to the file (external data at ``location``, the file's
    own name); None when the file is not a message this scan reads, or has no such weight."""
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as buf:
        try:
            pieces, referenced = _model_without_weights(buf, size, location, min_bytes)
        except _Unreadable:
            return None
        if not referenced:
            return None
        data = b"".join(pieces)
    proto = onnx.ModelProto()
    proto.ParseFromString(data)
    return proto


def _model_without_weights(buf, size: int, location: str, min_bytes: int
                           ) -> tuple[list[bytes], int]:
    pieces, referenced = [], 0
    for number, wire, start, payload, stop in _fields(buf, 0, size):
        if number == _MODEL_GRAPH and wire == _LEN:
            graph, count = _graph_without_weights(buf, payload, stop, location, min_bytes)
            pieces += [_length_delimited(number, len(graph)), graph]
            referenced += count
        else:
            pieces.append(buf[start:stop])
    return pieces, referenced


def _graph_without_weights(buf, start: int, end: int, location: str, min_bytes: int
                           ) -> tuple[bytes, int]:
    pieces, referenced = [], 0
    known = {f.number for f in onnx.TensorProto.DESCRIPTOR.fields}
    kept_from = start  # the fields since the last reference are copied in one slice
    for number, wire, field_start, payload, stop in _fields(buf, start, end):
        if number != _GRAPH_INITIALIZER or wire != _LEN or stop - payload < min_bytes:
            continue  # nodes, inputs, small tensors: kept as they are
        reference = _tensor_reference(buf, payload, stop, location, min_bytes, known)
        if reference is not None:
            pieces += [buf[kept_from:field_start], _length_delimited(number, len(reference)),
                       reference]
            kept_from = stop
            referenced += 1
    pieces.append(buf[kept_from:end])
    return b"".join(pieces), referenced


def _tensor_reference(buf, start: int, end: int, location: str, min_bytes: int,
                      known: set[int]) -> bytes | None:
    """The tensor's fields without its raw_data, plus external data naming where the bytes
    are; None for a tensor that stays as it is."""
    raw = None
    kept = []
    for number, wire, field_start, payload, stop in _fields(buf, start, end):
        if number in _TENSOR_EXTERNAL_FIELDS or number not in known:
            return None
        if number == _TENSOR_RAW_DATA and wire == _LEN:
            if raw is not None:
                return None  # a repeated scalar field: the last one counts; left alone
            raw = (payload, stop - payload)
        else:
            kept.append(buf[field_start:stop])
    if raw is None or raw[1] < min_bytes:
        return None
    offset, length = raw
    marker = onnx.TensorProto(data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", str(offset)),
                       ("length", str(length))):
        entry = marker.external_data.add()
        entry.key, entry.value = key, value
    return b"".join(kept) + marker.SerializeToString()


# ---- writing ----------------------------------------------------------------------------
def _split_at(message, number: int) -> tuple[bytes, bytes]:
    """The encoding of ``message``'s fields numbered below ``number``, and of those above it
    (with its unknown fields, which protobuf writes last)."""
    below, above = type(message)(), type(message)()
    below.CopyFrom(message)
    above.CopyFrom(message)
    below.DiscardUnknownFields()
    for field in message.DESCRIPTOR.fields:
        if field.number >= number:
            below.ClearField(field.name)
        if field.number <= number:
            above.ClearField(field.name)
    return below.SerializeToString(), above.SerializeToString()


# bytes; a referenced tensor's raw bytes (tensor, length); or a tensor encoded as it is
# written (one tensor's encoding in memory at a time, not the whole model's)
Piece = bytes | tuple[onnx.TensorProto, int] | onnx.TensorProto


def _tensor_pieces(tensor: onnx.TensorProto, length: int) -> tuple[list[Piece], int]:
    inline = onnx.TensorProto()
    inline.CopyFrom(tensor)
    inline.ClearField("external_data")
    inline.ClearField("data_location")
    below, above = _split_at(inline, _TENSOR_RAW_DATA)
    head = below + _length_delimited(_TENSOR_RAW_DATA, length)
    return [head, (tensor, length), above], len(head) + length + len(above)


def encoded_pieces(proto: onnx.ModelProto,
                   referenced: Callable[[onnx.TensorProto], int | None]
                   ) -> tuple[list[Piece], int]:
    """The model's encoding with each main-graph initializer for which ``referenced`` gives a
    byte length written inline with that many bytes of its own (a ``(tensor, length)`` piece:
    the writer copies them from where the tensor's reference points); and the total size."""
    graph = proto.graph
    inits: list[Piece] = []
    graph_size = 0
    for tensor in graph.initializer:
        length = referenced(tensor)
        if length is None:
            parts, size = [tensor], tensor.ByteSize()
        else:
            parts, size = _tensor_pieces(tensor, length)
        key = _length_delimited(_GRAPH_INITIALIZER, size)
        inits += [key, *parts]
        graph_size += len(key) + size
    bare_graph = _copy_without(graph, "initializer")
    graph_below, graph_above = _split_at(bare_graph, _GRAPH_INITIALIZER)
    graph_size += len(graph_below) + len(graph_above)
    bare_model = _copy_without(proto, "graph")
    model_below, model_above = _split_at(bare_model, _MODEL_GRAPH)
    graph_key = _length_delimited(_MODEL_GRAPH, graph_size)
    pieces = [model_below, graph_key, graph_below, *inits, graph_above, model_above]
    total = sum(piece_length(p) for p in pieces)
    return pieces, total


def _copy_without(message, skipped: str):
    """A copy of ``message`` without its field ``skipped``, made without copying that field
    (CopyFrom then ClearField would copy every weight once)."""
    return type(message)(**{field.name: value for field, value in message.ListFields()
                            if field.name != skipped})


def piece_length(piece: Piece) -> int:
    if isinstance(piece, bytes):
        return len(piece)
    if isinstance(piece, onnx.TensorProto):
        return piece.ByteSize()
    return piece[1]


def write_with_weights(pieces: list[Piece], dst, copy: Callable[[onnx.TensorProto, object], int]
                       ) -> None:
    """Write :func:`encoded_pieces`' pieces to the file object ``dst``; ``copy(tensor, dst)``
    appends a referenced tensor's bytes and returns how many it wrote."""
    for piece in pieces:
        if isinstance(piece, bytes):
            dst.write(piece)
        elif isinstance(piece, onnx.TensorProto):
            dst.write(piece.SerializeToString())
        else:
            tensor, length = piece
            if copy(tensor, dst) != length:
                raise OSError(f"the bytes of '{tensor.name}' changed size while written")
