"""A NumPy-backed stand-in for the ``cupy`` module that records every call the kernels make,
and a checker of those calls against the real CuPy API (importable without a GPU).

The executor takes its GPU branches whenever ``xp is not numpy``; running it with
``ArrayBackend("cuda", RecordingXp())`` therefore executes exactly the code a GPU run
executes, on NumPy arrays, while each ``xp.<name>(...)`` / ``xp.<ufunc>.<method>(...)``
call is recorded with its number of positional arguments and its keyword names.
:func:`cupy_incompatibilities` then resolves every recorded name in CuPy and binds the
arguments to CuPy's real signature.
"""

from __future__ import annotations

import inspect
import traceback
import types

import numpy as np

from graphopt.executor.kernels._util import _erf_numpy

# CuPy functions whose NumPy namesake takes different arguments: the stand-in accepts
# CuPy's form (the recorded call is what gets checked) and computes it with NumPy.
_ADAPTERS = {
    "random.random_sample": lambda size=None, dtype=float: np.asarray(
        np.random.random_sample(size)).astype(dtype),
}

# Calls that exist in CuPy but must not be used by kernels, with the reason.
FORBIDDEN = {
    ".at": "CuPy's ufunc.at coverage depends on the ufunc, dtype and version (multiply.at "
           "is missing, maximum/minimum.at reject float16 and bool, add.at rejects int64 "
           "before 14.1) and it uses atomics; use kernels._scatter.scatter_rows",
}

UFUNC_KWARGS = {"out", "dtype", "casting"}  # what cupy.ufunc.__call__ accepts


class Recorder:
    def __init__(self, device_arrays: bool = False):
        self.calls: set[tuple[str, int, frozenset[str]]] = set()
        self.attributes: set[str] = set()
        self.device_arrays = device_arrays
        self.reads: list[str] = []   # device->host copies of DeviceArrays, where they happened

    def call(self, path, args, kwargs):
        self.calls.add((path, len(args), frozenset(kwargs)))


class DeviceArray(np.ndarray):
    """A NumPy array standing for a CuPy array (``RecordingXp(device_arrays=True)``): what
    CuPy copies to the host, it counts in its recorder's ``reads`` (``get()``, ``item()``,
    ``tolist()``, ``float()``/``int()``/``bool()``/``operator.index``), naming the caller.
    Full reductions and scalar indexing give 0-d arrays, as CuPy's do (no copy yet)."""

    recorder: Recorder | None = None

    def __array_finalize__(self, obj):
        if self.recorder is None:
            self.recorder = getattr(obj, "recorder", None)

    def __array_wrap__(self, obj, context=None, return_scalar=False):
        return super().__array_wrap__(obj, context, False)

    def __getitem__(self, key):
        value = super().__getitem__(key)
        return _on_device(value, self.recorder) if isinstance(value, np.generic) else value

    def _read(self, how):
        if self.recorder is not None:
            callers = traceback.extract_stack(limit=6)[:-2]   # innermost last
            self.recorder.reads.append(how + " in " + " < ".join(
                f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})"
                for f in reversed(callers)))
        return self.view(np.ndarray)

    def get(self):
        return self._read("get()").copy()

    def item(self, *args):
        return self._read("item()").item(*args)

    def tolist(self):
        return self._read("tolist()").tolist()

    def __float__(self):
        return float(self._read("float()"))

    def __int__(self):
        return int(self._read("int()"))

    def __bool__(self):
        return bool(self._read("bool()"))

    def __index__(self):
        return self._read("index").__index__()


def _on_device(value, recorder):
    """A result of an ``xp`` call as CuPy would give it: arrays (and NumPy scalars, as 0-d
    arrays) become DeviceArrays."""
    if isinstance(value, DeviceArray):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value).view(DeviceArray)
        array.recorder = recorder
        return array
    if isinstance(value, (tuple, list)):
        return type(value)(_on_device(v, recorder) for v in value)
    return value


class _Function:
    def __init__(self, fn, path, recorder):
        self._fn, self._path, self._recorder = fn, path, recorder

    def __call__(self, *args, **kwargs):
        self._recorder.call(self._path, args, kwargs)
        result = self._fn(*args, **kwargs)
        if self._recorder.device_arrays:
            result = _on_device(result, self._recorder)
        return result


class _Ufunc(_Function):
    def __getattr__(self, name):  # at, reduce, accumulate, outer, reduceat, nin, ...
        value = getattr(self._fn, name)
        if callable(value):
            return _Function(value, f"{self._path}.{name}", self._recorder)
        return value


class _Namespace:
    def __init__(self, target, path, recorder):
        self._target, self._path, self._recorder = target, path, recorder

    def __getattr__(self, name):
        path = f"{self._path}{name}"
        if path in _ADAPTERS:
            return _Function(_ADAPTERS[path], path, self._recorder)
        value = getattr(self._target, name)
        if isinstance(value, types.ModuleType):
            return _Namespace(value, f"{path}.", self._recorder)
        if isinstance(value, np.ufunc):
            return _Ufunc(value, path, self._recorder)
        if isinstance(value, type) or not callable(value):
            self._recorder.attributes.add(path)  # dtypes, constants, ndarray
            return value
        return _Function(value, path, self._recorder)


class _Special:
    """Stands in for ``cupyx.scipy.special`` (see kernels._util.scipy_special)."""

    def __init__(self, recorder):
        self.erf = _Function(_erf_numpy, "cupyx.scipy.special.erf", recorder)


class RecordingXp(_Namespace):
    """``numpy`` under the name ``cupy_api_recorder``, recording every call.
    ``device_arrays``: the arrays its calls return are :class:`DeviceArray` s, which count
    their reads back to the host (``recorder.reads``)."""

    __name__ = "cupy_api_recorder"

    def __init__(self, device_arrays: bool = False):
        super().__init__(np, "", Recorder(device_arrays))
        self.scipy_special = _Special(self._recorder)

    @property
    def recorder(self) -> Recorder:
        return self._recorder


def _resolve(root, path):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def cupy_incompatibilities(recorder: Recorder) -> list[str]:
    """Every recorded call or attribute that CuPy does not have with those arguments."""
    import cupy  # noqa: PLC0415 - callers skip without it
    import cupyx.scipy.special  # noqa: F401, PLC0415

    roots = {"cupyx": __import__("cupyx")}
    problems = []
    for path in sorted(recorder.attributes):
        try:
            _resolve(cupy, path)
        except AttributeError:
            problems.append(f"cupy.{path}: no such attribute")
    for path, n_args, kwargs in sorted(recorder.calls, key=lambda c: (c[0], c[1], sorted(c[2]))):
        head = path.split(".")[0]
        root = roots.get(head, cupy)
        relative = path[len(head) + 1:] if head in roots else path
        name = f"{head}.{relative}" if head in roots else f"cupy.{path}"
        call = f"{name}({n_args} positional{', ' if kwargs else ''}{', '.join(sorted(kwargs))})"
        forbidden = [why for suffix, why in FORBIDDEN.items() if path.endswith(suffix)]
        if forbidden:
            problems.append(f"{call}: {forbidden[0]}")
            continue
        try:
            target = _resolve(root, relative)
        except AttributeError:
            problems.append(f"{call}: CuPy has no {name}")
            continue
        if isinstance(target, cupy.ufunc):
            extra = set(kwargs) - UFUNC_KWARGS
            if extra:
                problems.append(f"{call}: cupy ufuncs take no {sorted(extra)}")
            elif not target.nin <= n_args <= target.nin + target.nout:
                problems.append(f"{call}: {name} takes {target.nin} inputs")
            continue
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            continue  # a ufunc method or a Cython function: existence is all we can check
        try:
            signature.bind(*range(n_args), **dict.fromkeys(kwargs))
        except TypeError as exc:
            problems.append(f"{call}: {exc} (CuPy signature {signature})")
    return problems
