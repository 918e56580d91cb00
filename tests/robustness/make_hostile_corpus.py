#!/usr/bin/env python
"""Write a corpus of broken and hostile ONNX inputs for the CLI to refuse cleanly.

    python tests/robustness/make_hostile_corpus.py OUTDIR

Every case lives in its own folder ``OUTDIR/<case>/`` (so external-data cases have a folder
of their own) and the model path to give the CLI is ``OUTDIR/<case>/model.onnx``. A file
outside every case folder, ``OUTDIR/outside/secret.bin``, is the sentinel that cases with
external data escaping their folder point at: a tool that reads it has read outside the
model's folder. ``OUTDIR/manifest.json`` lists the cases: name, model path (relative to
OUTDIR), what is wrong, ``escapes`` (true when the case points outside its folder) and
``commands`` (those that must refuse it: a valid model that only ``run`` cannot train lists
``["run"]``).

A case may also say where the output goes: ``output`` (a path inside its folder, e.g. the
model's own external data file) instead of a fresh file elsewhere, and ``args`` (per command,
``optimize`` or ``run``: more options; ``{CASE}`` stands for the case folder, ``{OUT}`` for the
output path).

Expected of graphopt for every case: exit code 1, one line on stderr starting with
"graphopt: error:", no traceback, nothing written, nothing read outside the model's folder.
A case whose manifest entry has ``accepts`` (e.g. ["optimize"]) is a trap for those commands
instead: they must exit 0 and write a model that passes the full ONNX check (a few hundred
bytes that would make a careless tool allocate gigabytes, declarations that lie, names
that collide), with nothing else written and nothing read outside.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, os.pardir, "fixtures", "mqa_opset17.onnx")
SENTINEL = os.path.join("outside", "secret.bin")
MS = "com.microsoft"


def _small_model(nodes=None, inits=(), opset=17, extra_opsets=(), inputs=None, outputs=None,
                 value_info=()) -> onnx.ModelProto:
    nodes = nodes if nodes is not None else [
        helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    inputs = inputs if inputs is not None else [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])]
    outputs = outputs if outputs is not None else [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])]
    if not inits and any("W" in n.input for n in nodes):
        inits = [numpy_helper.from_array(np.ones((4, 4), np.float32), "W")]
    graph = helper.make_graph(nodes, "hostile", inputs, outputs, initializer=list(inits),
                              value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    *extra_opsets])
    model.ir_version = 8
    return model


def _external(location: str, offset: int | str = 0, length: int | str = 64,
              dims=(4, 4)) -> onnx.ModelProto:
    """A model whose weight W lives in external data at ``location``."""
    model = _small_model()
    weight = model.graph.initializer[0]
    del weight.dims[:]
    weight.dims.extend(dims)
    _make_external(weight, location, offset, length)
    return model


def _make_external(tensor: onnx.TensorProto, location: str, offset: int | str = 0,
                   length: int | str = 64) -> None:
    for field in ("raw_data", "float_data", "int64_data"):
        tensor.ClearField(field)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)),
                       ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _function_external(location: str) -> onnx.ModelProto:
    """A local function whose Constant [4,4] float value is external data at ``location``."""
    value = numpy_helper.from_array(np.ones((4, 4), np.float32), "c")
    _make_external(value, location)
    function = helper.make_function(
        "local", "AddC", ["X"], ["Y"], [helper.make_node("Constant", [], ["C"], value=value),
                                        helper.make_node("MatMul", ["X", "C"], ["Y"])],
        [helper.make_opsetid("", 17)])
    model = _small_model([helper.make_node("AddC", ["x"], ["y"], domain="local")],
                         extra_opsets=[helper.make_opsetid("local", 1)])
    model.functions.append(function)
    return model


def _sparse_external(location: str) -> onnx.ModelProto:
    """A [4,4] sparse initializer S whose 16 float values are external data at ``location``."""
    values = numpy_helper.from_array(np.ones(16, np.float32), "S")
    _make_external(values, location)
    sparse = helper.make_sparse_tensor(
        values, numpy_helper.from_array(np.arange(16, dtype=np.int64), "S_idx"), [4, 4])
    model = _small_model([helper.make_node("MatMul", ["x", "S"], ["y"])],
                         inits=[numpy_helper.from_array(np.ones(1, np.float32), "unused")])
    del model.graph.initializer[:]
    model.graph.sparse_initializer.append(sparse)
    return model


class Corpus:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.cases: list[dict] = []

    def folder(self, name: str) -> str:
        path = os.path.join(self.root, name)
        os.makedirs(path, exist_ok=True)
        return path

    def add(self, name: str, what: str, data: bytes | onnx.ModelProto | None = None,
            escapes: bool = False, extra: dict[str, bytes] | None = None,
            output: str | None = None, args: dict[str, list[str]] | None = None,
            commands: list[str] | None = None,
            accepts: tuple[str, ...] = ()) -> str:
        folder = self.folder(name)
        model_path = os.path.join(folder, "model.onnx")
        if isinstance(data, onnx.ModelProto):
            data = data.SerializeToString()
        if data is not None:
            with open(model_path, "wb") as f:
                f.write(data)
        for rel, content in (extra or {}).items():
            with open(os.path.join(folder, rel), "wb") as f:
                f.write(content)
        case = {"name": name, "model": os.path.relpath(model_path, self.root), "what": what,
                "escapes": escapes, "commands": commands or ["optimize", "run"]}
        if output is not None:
            case["output"] = output
        if args:
            case["args"] = args
        if accepts:  # commands that must succeed (exit 0, a valid model written), not refuse
            case["accepts"] = list(accepts)
        self.cases.append(case)
        return model_path

    def write_manifest(self) -> None:
        with open(os.path.join(self.root, "manifest.json"), "w") as f:
            json.dump({"sentinel": SENTINEL, "cases": self.cases}, f, indent=1)


def _still_valid(data: bytes) -> bool:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
        onnx.checker.check_model(proto)
    except Exception:
        return False
    return True


def make(root: str, truncations: int = 24) -> Corpus:
    """Write the corpus under ``root``; ``truncations``: how many evenly spaced cut points of
    the real model (besides a few fixed ones near both ends)."""
    if os.path.exists(root):
        shutil.rmtree(root)
    corpus = Corpus(root)
    os.makedirs(os.path.join(corpus.root, "outside"))
    with open(os.path.join(corpus.root, SENTINEL), "wb") as f:
        f.write(np.arange(16, dtype=np.float32).tobytes() * 64)

    # ---- not ONNX at all -------------------------------------------------------------
    corpus.add("empty_file", "empty file", b"")
    for seed in range(5):
        rng = np.random.default_rng(seed)
        size = int(rng.integers(1, 4096))
        corpus.add(f"random_bytes_{seed}", f"{size} random bytes (seed {seed})",
                   rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    corpus.add("text_file", "a text file", b"this is not an onnx model\n" * 10)
    corpus.add("other_protobuf", "a serialized TensorProto, not a ModelProto",
               numpy_helper.from_array(np.ones((3, 3), np.float32), "t").SerializeToString())

    # ---- truncated real model ------------------------------------------------------------
    with open(FIXTURE, "rb") as f:
        real = f.read()
    offsets = sorted({1, 2, 3, 7, 16, 64, 256, 1024, len(real) - 1, len(real) - 2,
                      *[len(real) * k // truncations for k in range(1, truncations)]})
    for offset in offsets:
        data = real[:offset]
        if _still_valid(data):
            continue  # cut on a field boundary into a smaller valid model: not hostile
        corpus.add(f"truncated_{offset:07d}", f"mqa_opset17.onnx cut at byte {offset} "
                   f"of {len(real)}", data)

    # ---- structurally broken graphs ----------------------------------------------------
    corpus.add("opset_999", "default-domain opset 999", _small_model(opset=999))
    corpus.add("opset_0", "default-domain opset 0", _small_model(opset=0))
    no_opset = _small_model()
    del no_opset.opset_import[:]
    corpus.add("no_opset_import", "no opset_import at all", no_opset)
    future_ir = _small_model()
    future_ir.ir_version = 99
    corpus.add("ir_version_99", "ir_version 99", future_ir)
    corpus.add("unknown_domain_op", "op of a domain that has no opset_import",
               _small_model([helper.make_node("Boom", ["x"], ["y"], domain="com.evil")]))
    corpus.add("unknown_standard_op", "op that does not exist in the default domain",
               _small_model([helper.make_node("NotAnOp", ["x"], ["y"])]))
    corpus.add("dangling_input", "node reads a tensor nothing defines",
               _small_model([helper.make_node("Add", ["x", "ghost"], ["y"])]))
    corpus.add("dangling_output", "graph output nothing produces",
               _small_model([helper.make_node("Relu", ["x"], ["r"])]))
    corpus.add("duplicate_output_names", "two nodes produce the same tensor",
               _small_model([helper.make_node("Relu", ["x"], ["y"]),
                             helper.make_node("Neg", ["x"], ["y"])]))
    corpus.add("cycle", "a -> b -> a",
               _small_model([helper.make_node("Add", ["x", "b"], ["a"]),
                             helper.make_node("Relu", ["a"], ["b"]),
                             helper.make_node("Relu", ["b"], ["y"])]))
    corpus.add("self_loop", "a node reads its own output",
               _small_model([helper.make_node("Add", ["x", "y"], ["y"])]))
    corpus.add("wrong_attribute_type", "Transpose perm given as a float",
               _small_model([helper.make_node("Transpose", ["x"], ["y"], perm=1.5)]))
    corpus.add("if_without_branches", "If node without then/else graphs",
               _small_model([helper.make_node("If", ["c"], ["y"])],
                            inputs=[helper.make_tensor_value_info("c", TensorProto.BOOL, [])]))
    contradiction = _small_model(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Relu", ["r"], ["y1"]),
         helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
         helper.make_node("Transpose", ["t"], ["y"], perm=[1, 0])],
        outputs=[helper.make_tensor_value_info("y1", TensorProto.FLOAT, [2, 4]),
                 helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [7, 7])])
    corpus.add("value_info_contradicts_graph",
               "passes onnx.checker, fails strict shape inference (value_info [7,7] for a "
               "[2,4] tensor) while a rule fires elsewhere", contradiction)

    # ---- huge declared sizes -----------------------------------------------------------
    huge = _small_model()
    weight = huge.graph.initializer[0]
    del weight.dims[:]
    weight.dims.extend([2**62, 2**62])
    corpus.add("huge_initializer_dims", "initializer dims [2**62, 2**62], 64 bytes of data",
               huge)
    huge1 = _small_model()
    weight = huge1.graph.initializer[0]
    del weight.dims[:]
    weight.dims.extend([2**62])
    corpus.add("huge_initializer_dim", "initializer dims [2**62], 64 bytes of data", huge1)
    negative = _small_model()
    del negative.graph.initializer[0].dims[:]
    negative.graph.initializer[0].dims.extend([-4, -4])
    corpus.add("negative_initializer_dims", "initializer dims [-4, -4]", negative)
    corpus.add("huge_external_dims", "external initializer declared [2**62, 2**62]",
               _external("w.bin", dims=(2**62, 2**62), length=64),
               extra={"w.bin": b"\0" * 64})

    # ---- external data -------------------------------------------------------------
    sentinel_rel = os.path.join(os.pardir, SENTINEL)
    corpus.add("external_parent_escape", "external data at ../outside/secret.bin (exists)",
               _external(sentinel_rel), escapes=True)
    corpus.add("external_etc_passwd", "external data at ../../../../../../etc/passwd",
               _external("../../../../../../etc/passwd"), escapes=True)
    corpus.add("external_absolute_sentinel", "external data at the sentinel's absolute path",
               _external(os.path.join(corpus.root, SENTINEL)), escapes=True)
    corpus.add("external_absolute_etc", "external data at /etc/passwd",
               _external("/etc/passwd"), escapes=True)
    corpus.add("external_traversal_via_subdir", "external data at sub/../../outside/secret.bin",
               _external(os.path.join("sub", os.pardir, sentinel_rel)), escapes=True)
    path = corpus.add("external_symlink_escape", "w.bin in the folder is a symlink to the "
                      "sentinel outside", _external("w.bin"), escapes=True)
    os.symlink(os.path.join(corpus.root, SENTINEL), os.path.join(os.path.dirname(path), "w.bin"))
    corpus.add("external_missing_file", "external data file does not exist",
               _external("missing.bin"))
    corpus.add("external_offset_beyond_file", "offset 4096 in a 64-byte file",
               _external("w.bin", offset=4096), extra={"w.bin": b"\0" * 64})
    corpus.add("external_length_beyond_file", "length 1 MiB in a 64-byte file",
               _external("w.bin", length=1 << 20), extra={"w.bin": b"\0" * 64})
    corpus.add("external_length_mismatch", "length 32 for a [4,4] float tensor (64 bytes)",
               _external("w.bin", length=32), extra={"w.bin": b"\0" * 64})
    corpus.add("external_offset_not_a_number", "offset 'abc'",
               _external("w.bin", offset="abc"), extra={"w.bin": b"\0" * 64})
    corpus.add("external_negative_offset", "offset -64",
               _external("w.bin", offset=-64), extra={"w.bin": b"\0" * 64})
    corpus.add("external_empty_location", "external data with location ''",
               _external(""))
    path = corpus.add("external_location_is_directory", "external data location is a folder",
                      _external("weights"))
    os.makedirs(os.path.join(os.path.dirname(path), "weights"))

    corpus.add("function_external_escape", "a local function's Constant has external data at "
               "../outside/secret.bin", _function_external(sentinel_rel), escapes=True)
    corpus.add("sparse_external_escape", "a sparse initializer's values are external data at "
               "../outside/secret.bin", _sparse_external(sentinel_rel), escapes=True)
    corpus.add("function_external_missing", "a local function's Constant has external data in "
               "a file that does not exist", _function_external("missing.bin"))
    path = corpus.add("external_data_is_fifo", "external data file w.bin is a FIFO (no writer)",
                      _external("w.bin"))
    os.mkfifo(os.path.join(os.path.dirname(path), "w.bin"))

    # ---- outputs onto the input's own files (a valid model: only the output is wrong) ----
    weights = {"w.bin": np.ones(16, np.float32).tobytes()}
    corpus.add("output_onto_external_data", "-o is the model's own external data file w.bin",
               _external("w.bin"), extra=weights, output="w.bin")
    path = corpus.add("output_onto_external_data_dotdot", "-o sub/../w.bin, the model's own "
                      "external data file", _external("w.bin"), extra=weights,
                      output=os.path.join("sub", os.pardir, "w.bin"))
    os.makedirs(os.path.join(os.path.dirname(path), "sub"))
    path = corpus.add("output_symlink_to_external_data", "-o link.bin, a symlink to the model's "
                      "external data file", _external("w.bin"), extra=weights, output="link.bin")
    os.symlink("w.bin", os.path.join(os.path.dirname(path), "link.bin"))
    corpus.add("second_output_onto_external_data", "--report (optimize) or --save-graph (run) "
               "is the model's external data file", _external("w.bin"), extra=weights,
               args={"optimize": ["--report", os.path.join("{CASE}", "w.bin")],
                     "run": ["--save-graph", os.path.join("{CASE}", "w.bin")]})
    corpus.add("second_output_onto_output", "--report (optimize) or --save-graph (run) is the "
               "-o file", _external("w.bin"), extra=weights,
               args={"optimize": ["--report", "{OUT}"], "run": ["--save-graph", "{OUT}"]})
    corpus.add("second_output_onto_model", "--report (optimize) or --save-graph (run) is the "
               "model itself", _external("w.bin"), extra=weights,
               args={"optimize": ["--report", os.path.join("{CASE}", "model.onnx")],
                     "run": ["--save-graph", os.path.join("{CASE}", "model.onnx")]})

    # ---- not a regular file ------------------------------------------------------------
    path = corpus.add("model_is_fifo", "model.onnx is a FIFO (no writer: reading blocks)")
    os.mkfifo(path)
    path = corpus.add("model_is_dev_zero", "model.onnx -> /dev/zero (endless zeros)")
    os.symlink("/dev/zero", path)
    path = corpus.add("model_is_dev_urandom", "model.onnx -> /dev/urandom (endless bytes)")
    os.symlink("/dev/urandom", path)

    # ---- not a file ----------------------------------------------------------------
    path = corpus.add("directory_instead_of_file", "model.onnx is a directory")
    os.makedirs(path)
    path = corpus.add("symlink_loop", "model.onnx -> loop.onnx -> model.onnx")
    os.symlink("loop.onnx", path)
    os.symlink("model.onnx", os.path.join(os.path.dirname(path), "loop.onnx"))
    path = corpus.add("dangling_symlink", "model.onnx -> a file that does not exist")
    os.symlink("nowhere.onnx", path)
    corpus.add("missing_file", "model.onnx does not exist")
    _training_state_cases(corpus)
    add_memory_and_result_traps(corpus)
    add_output_guard_cases(corpus)
    corpus.write_manifest()
    return corpus


def external_constant_scale(location: str) -> onnx.FunctionProto:
    """local.Scale(a) = a * C, its Constant C a float [4, 4] kept in external data at
    ``location`` (64 bytes from offset 0)."""
    value = TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[4, 4],
                        data_location=TensorProto.EXTERNAL)
    for key, text in (("location", location), ("offset", "0"), ("length", "64")):
        entry = value.external_data.add()
        entry.key, entry.value = key, text
    return helper.make_function("local", "Scale", ["a"], ["b"],
                                [helper.make_node("Constant", [], ["C"], value=value),
                                 helper.make_node("Mul", ["a", "C"], ["b"])],
                                [helper.make_opsetid("", 17)])


def _function_constant_model(location: str) -> onnx.ModelProto:
    """W trained through a local function whose Constant keeps its value in external data."""
    scale = external_constant_scale(location)
    model = _small_model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                          helper.make_node("Scale", ["h"], ["y"], domain="local")],
                         extra_opsets=[helper.make_opsetid("local", 1)])
    model.functions.append(scale)
    return model


def _run_input(dims=("N", 2, 4)):
    """An input the hostile run's data (x: 4 x [2, 4]) fits, so run gets past the data."""
    return [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))]


def _training_state_cases(corpus: Corpus) -> None:
    """Inputs on which graphopt must print one error line, never a traceback or a second line
    (NUL bytes in external data locations, a local function's Constant in external data, models
    ``run`` cannot train). Cases marked ``commands: ["run"]`` are valid models that only
    ``graphopt run`` must refuse (optimize rewrites them as it should)."""
    corpus.add("external_location_nul_byte", "external data location 'w\\0.bin' (a NUL byte)",
               _external("w\0.bin"), extra={"w.bin": b"\0" * 64})
    nul = _external("w.bin")
    nul.graph.initializer[0].external_data[0].value = "sub\0/../w.bin"
    corpus.add("external_location_nul_byte_in_folder", "external data location with a NUL "
               "byte in a folder name", nul, extra={"w.bin": b"\0" * 64})
    path = corpus.add("external_function_constant_symlink", "a local function's Constant keeps "
                      "its value in external data at w.bin, a symlink in the folder",
                      _function_constant_model("w.bin"),
                      extra={"real.bin": np.ones(16, np.float32).tobytes()})
    os.symlink("real.bin", os.path.join(os.path.dirname(path), "w.bin"))
    corpus.add("external_function_constant_nul_byte", "a local function's Constant with "
               "external data at 'c\\0.bin'", _function_constant_model("c\0.bin"))
    # valid models `run` cannot train: one line each, never a traceback or two lines
    scalar = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])]
    shrink = _small_model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                           helper.make_node("Shrink", ["x"], ["c"], name="running_total"),
                           helper.make_node("Mul", ["h", "c"], ["p"]),
                           helper.make_node("ReduceSum", ["p"], ["y"], keepdims=0)],
                          inits=[numpy_helper.from_array(np.ones((4, 4), np.float32), "W")],
                          inputs=_run_input(), outputs=scalar)
    corpus.add("run_unsupported_op", "Shrink on the data path: no executor kernel", shrink,
               commands=["run"])
    integer = _small_model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                            helper.make_node("ReduceSum", ["h"], ["s"], keepdims=0),
                            helper.make_node("Cast", ["s"], ["y"], to=TensorProto.INT64)],
                           inputs=_run_input(),
                           outputs=[helper.make_tensor_value_info("y", TensorProto.INT64, [])])
    corpus.add("run_integer_loss_output", "the only output (the loss) is an int64",
               integer, commands=["run"])
    nothing = _small_model([helper.make_node("Relu", ["x"], ["r"]),
                            helper.make_node("ReduceSum", ["r"], ["y"], keepdims=0)],
                           inputs=_run_input(), outputs=scalar)
    corpus.add("run_nothing_to_train", "no initializer at all", nothing, commands=["run"])
def _npz_bomb(name: str, elements: int) -> bytes:
    """A compressed .npz whose one array's header declares ``elements`` float32 values
    followed by a few KB of zeros: what it would decompress to, it says, not what it holds."""
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open(f"{name}.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(
                f, {"descr": "<f4", "fortran_order": False, "shape": (elements, 4)})
            f.write(bytes(4096))
    return buffer.getvalue()


def add_memory_and_result_traps(corpus: Corpus) -> None:
    """Memory and result traps: tiny models whose constants would fold to gigabytes, a
    FusedMatMul whose output the memory guard must count, a second YieldOp hidden in an If
    branch, an If branch reading a tensor a rewrite removes, a sparse initializer named like
    a generated constant, and value_info that lies about the axis the Split fusion splits."""
    f = TensorProto.FLOAT
    scalar_out = [helper.make_tensor_value_info("s", f, [])]
    one = numpy_helper.from_array(np.array([1.0], np.float32))

    def ints(name, value):
        return numpy_helper.from_array(np.array(value, np.int64), name)

    def floats(name, value):
        return numpy_helper.from_array(np.array(value, np.float32), name)

    def folds_to(node, inits):  # node -> "big" -> ReduceSum -> s; no graph input
        return _small_model([node, helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0)],
                            inits, inputs=[], outputs=scalar_out)

    big = 1 << 29
    for name, node, inits in (
            ("fold_constant_of_shape_2gib", helper.make_node(
                "ConstantOfShape", ["shape"], ["big"], value=one), [ints("shape", [big])]),
            ("fold_range_2gib", helper.make_node("Range", ["a", "b", "c"], ["big"]),
             [floats("a", 0.0), floats("b", float(big)), floats("c", 1.0)]),
            ("fold_expand_2gib", helper.make_node("Expand", ["one", "shape"], ["big"]),
             [floats("one", [1.0]), ints("shape", [big])]),
            ("fold_tile_2gib", helper.make_node("Tile", ["one", "reps"], ["big"]),
             [floats("one", [1.0]), ints("reps", [big])])):
        corpus.add(name, f"{node.op_type} of tiny constants makes 2 GiB, then ReduceSum "
                   "(optimize: left unfolded, in little memory)",
                   folds_to(node, inits), accepts=("optimize",))

    ms = helper.make_opsetid(MS, 1)
    n = 1 << 17
    corpus.add("fused_matmul_64gib_output", "FusedMatMul [2**17,1] x [1,2**17]: a 64 GiB "
               "output the memory guard must count (run refuses before running)",
               _small_model([helper.make_node("FusedMatMul", ["x", "W"], ["p"], domain=MS),
                             helper.make_node("ReduceSum", ["p"], ["s"], keepdims=0)],
                            [floats("W", np.ones((1, n)))], extra_opsets=[ms],
                            inputs=[helper.make_tensor_value_info("x", f, [n, 1])],
                            outputs=scalar_out), accepts=("optimize",))

    def branch(tag, nodes, source):
        return helper.make_graph(nodes + [helper.make_node("Identity", [source], [f"{tag}_o"])],
                                 tag, [], [helper.make_tensor_value_info(f"{tag}_o", f, None)])

    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    hidden = helper.make_node("YieldOp", ["loss"], ["hidden_grad"], domain=MS,
                              name="hidden_yield", full_shape_outputs=[0])
    corpus.add("yieldop_in_if_branch", "a training graph's YieldOp, and a second one inside "
               "an If branch", _small_model(
                   [helper.make_node("ReduceSum", ["x"], ["loss"], keepdims=0),
                    helper.make_node("YieldOp", ["loss"], ["loss_grad"], domain=MS,
                                     name="yield", full_shape_outputs=[0]),
                    helper.make_node("If", ["c"], ["picked"],
                                     then_branch=branch("then", [hidden], "loss"),
                                     else_branch=branch("else", [], "loss")),
                    helper.make_node("Identity", ["loss_grad"], ["y"])],
                   extra_opsets=[ms], inputs=[helper.make_tensor_value_info("x", f, [2, 4]),
                                              cond],
                   outputs=[helper.make_tensor_value_info("picked", f, []),
                            helper.make_tensor_value_info("y", f, [])]))

    corpus.add("if_branch_reads_cancelled_transposes", "Transpose(Transpose(x)) cancels out "
               "and an If branch reads its result from the outer scope", _small_model(
                   [helper.make_node("Transpose", ["x"], ["t1"], perm=[1, 0]),
                    helper.make_node("Transpose", ["t1"], ["t2"], perm=[1, 0]),
                    helper.make_node("If", ["c"], ["y"], then_branch=branch("then", [], "t2"),
                                     else_branch=branch("else", [], "t2"))],
                   inputs=[helper.make_tensor_value_info("x", f, [2, 4]), cond]),
               accepts=("optimize",))

    sliced = _small_model(
        [helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("Slice", ["r", "s0", "e0", "ax"], ["a"]),
         helper.make_node("Slice", ["r", "s1", "e1", "ax"], ["b"])],
        [ints("s0", [0]), ints("e0", [3]), ints("s1", [3]), ints("e1", [6]), ints("ax", [1])],
        inputs=[helper.make_tensor_value_info("x", f, ["B", 6, 4])],
        outputs=[helper.make_tensor_value_info("a", f, ["B", 3, 4]),
                 helper.make_tensor_value_info("b", f, ["B", 3, 4])])
    sliced.graph.sparse_initializer.append(helper.make_sparse_tensor(
        floats("split_sizes", [5.0]), ints("", [1]), [3]))
    corpus.add("sparse_initializer_named_split_sizes", "a sparse initializer named like the "
               "constant the Split fusion generates", sliced, accepts=("optimize",))

    lying = _small_model(
        [helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("Gather", ["r", "i0"], ["first"], axis=1),
         helper.make_node("Slice", ["r", "s", "e", "ax"], ["rest"])],
        [ints("i0", 0), ints("s", [1]), ints("e", [6]), ints("ax", [1])],
        inputs=[helper.make_tensor_value_info("x", f, ["B", "S", 4])],
        outputs=[helper.make_tensor_value_info("first", f, ["B", 4]),
                 helper.make_tensor_value_info("rest", f, ["B", None, 4])],
        value_info=[helper.make_tensor_value_info("r", f, [2, 6, 4])])
    corpus.add("data_npz_declares_4tib", "--data archive whose array x declares 2**40 float32 "
               "(4 TiB) in a few bytes: run refuses from the header, before decompressing",
               _small_model(), extra={"bomb.npz": _npz_bomb("x", 1 << 40)},
               args={"run": ["--data", "{CASE}/bomb.npz"]}, accepts=("optimize",))
    corpus.add("value_info_lies_about_split_axis", "value_info says [2,6,4] for a [B,S,4] "
               "tensor that a Gather and a Slice would tile only if S is 6", lying,
               accepts=("optimize",))


def _trainable_model() -> onnx.ModelProto:
    """x [N, 2, 4] -> MatMul W -> ReduceSum: a scalar loss ``run --loss output`` trains."""
    return _small_model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                         helper.make_node("ReduceSum", ["h"], ["y"], keepdims=0)],
                        inputs=_run_input(),
                        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])


def _npz(**arrays) -> bytes:
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def add_output_guard_cases(corpus: Corpus) -> None:
    """Outputs that would replace a file the command reads (training data, held-out data,
    a checkpoint folder that holds the data), outputs that are FIFOs, and names that carry
    control characters into the one error line. Each must be one line, nothing changed."""
    data = {"d.npz": _npz(x=np.ones((4, 2, 4), np.float32))}
    corpus.add("run_output_onto_data", "-o is the --data file", _trainable_model(),
               extra=data, output="d.npz", args={"run": ["--data", "{CASE}/d.npz"]},
               commands=["run"])
    corpus.add("run_report_onto_eval_data", "--denormal-report is the --eval-data file",
               _trainable_model(), extra=data,
               args={"run": ["--eval-data", "{CASE}/d.npz", "--denormal-report",
                             "{CASE}/d.npz"]}, commands=["run"])
    path = corpus.add("run_save_graph_through_symlink_to_data", "--save-graph g.onnx, a "
                      "symlink to the --data file", _trainable_model(), extra=data,
                      args={"run": ["--data", "{CASE}/d.npz", "--save-graph", "{CASE}/g.onnx"]},
                      commands=["run"])
    os.symlink("d.npz", os.path.join(os.path.dirname(path), "g.onnx"))
    path = corpus.add("run_checkpoint_folder_holds_data", "--checkpoint ck, whose "
                      "checkpoint.npz is a hard link to the --data file", _trainable_model(),
                      extra=data, args={"run": ["--data", "{CASE}/d.npz", "--checkpoint",
                                                "{CASE}/ck"]}, commands=["run"])
    os.makedirs(os.path.join(os.path.dirname(path), "ck"))
    os.link(os.path.join(os.path.dirname(path), "d.npz"),
            os.path.join(os.path.dirname(path), "ck", "checkpoint.npz"))
    for option, name in (("--log", "log.csv"), ("--plot", "p.png"),
                         ("--denormal-report", "r.json")):
        path = corpus.add(f"run_{option.strip('-').replace('-', '_')}_is_fifo",
                          f"{option} {name} is a FIFO (no reader: writing blocks)",
                          _trainable_model(), args={"run": [option, "{CASE}/" + name]},
                          commands=["run"])
        os.mkfifo(os.path.join(os.path.dirname(path), name))
    path = corpus.add("optimize_report_is_fifo", "--report r.json is a FIFO",
                      _small_model(), args={"optimize": ["--report", "{CASE}/r.json"]},
                      commands=["optimize"])
    os.mkfifo(os.path.join(os.path.dirname(path), "r.json"))
    path = corpus.add("output_is_fifo", "-o out.onnx is a FIFO", _trainable_model(),
                      output="out.onnx")
    os.mkfifo(os.path.join(os.path.dirname(path), "out.onnx"))
    hostile = "x\ninjected: line\x1b[2J\u202e"
    corpus.add("name_with_control_characters", "a dangling input whose name holds a newline, "
               "a terminal escape and a bidi override (the error must stay one line)",
               _small_model([helper.make_node("MatMul", [hostile, "W"], ["y"])]))


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    corpus = make(argv[1])
    print(f"wrote {len(corpus.cases)} hostile inputs to {corpus.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
