"""``check``: another implementation's dump against the exact reference (``exact.py``).

A dump is one record per rank (a ``rank{r}.npz`` file or an in-memory dict of arrays) with:

* ``in/{name}/{k}``: the rank's local gradient of micro-step ``k`` (param shape);
* ``out/{name}``: what the rank holds after the sync (full gradient for ``all_reduce``, and for
  ``reduce`` on the root; non-root ranks of ``reduce`` may dump their buffer, checked against
  Paddle's rule; for ``reduce_scatter`` the rank's 1-D piece);
* ``range/{name}``: ``[begin, end)`` (two ints) of the flattened param that the rank's
  ``out/{name}`` (reduce_scatter, or all_reduce: the piece of the full result a rank keeps;
  not reduce, refused there) and ``shard/{name}`` cover: FSDP2 dim-0 shards, ZeRO flat
  partitions, Megatron distributed-optimizer shards. Without it, ``reduce_scatter`` pieces are
  cut as Paddle cuts them (the rank's slice of the padded buffer, padding included);
* ``shard/{name}`` (1-D) and ``param/{name}`` (param shape): the rank's param shard before the
  all-gather (``sync_params``) and the full param after it, checked bit-exact.

What it finds goes into a :class:`~mpifusion.oracle.report.CheckReport` (``report.py``).
"""
from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from ..dtypes import as_dtype, dtype_name
from ..plan.grouping import grad_dtype_for
from ..spec import as_spec
from .bound import ErrorStats, bound_model, error_bound
from .dumps import DumpError, DumpFile, rank_files, read_array
from .inputs import ExactInputCheck, exact_formula, exact_tolerance
from .diagnose import diagnose_failure
from .exact import ExactStream
from .report import CheckReport, CoverageIssue, SyncStats


DumpsLike = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]", Mapping]]]


# --------------------------------------------------------------------------- inputs


class _MemoryDump:
    """An in-memory rank record (``{key: array}``) read like a :class:`~.dumps.DumpFile`:
    ``files``, ``in`` and ``[key]`` (the array as given)."""

    def __init__(self, arrays: Mapping, label: str) -> None:
        for key in arrays:
            if not isinstance(key, str):
                raise DumpError(f"{label}: key {key!r}: expected a string such as 'out/w'")
        self._arrays = arrays
        self.files = list(arrays)
        self.path = label

    def __contains__(self, key: str) -> bool:
        return key in self._arrays

    def __getitem__(self, key: str) -> np.ndarray:
        value = self._arrays[key]
        if isinstance(value, np.ndarray):
            return value
        if value is None or isinstance(value, (str, bytes, bytearray, Mapping)):
            raise DumpError(f"{self.path}: {key}: expected an array, got "
                            f"{type(value).__name__}")
        try:
            return np.asarray(value)
        except Exception as exc:  # a framework tensor numpy cannot read (e.g. on a GPU)
            raise DumpError(f"{self.path}: {key}: not convertible to a numpy array "
                            f"({type(value).__name__}: {exc})") from None

    def close(self) -> None:
        pass


def _bad_range(label: str, key: str, dtype: Any, shape: tuple) -> DumpError:
    return DumpError(f"{label}: {key}: expected two ints [begin, end) of the flattened param, "
                     f"got dtype {dtype} shape {list(shape)}")


def _int_pair(f: Any, label: str, key: str) -> tuple:
    """``range/{name}`` as two Python ints; a file's header is checked before its data is
    read."""
    if isinstance(f, _MemoryDump):
        shape, dtype = f[key].shape, f[key].dtype
    else:
        m = f.member(key)
        shape, dtype = m.shape, m.dtype
    if tuple(shape) != (2,) or dtype.kind not in "iu":
        raise _bad_range(label, key, dtype, shape)
    arr = f[key]
    return int(arr[0]), int(arr[1])


def _open_dumps(dumps: Any, nranks: Optional[int]) -> tuple:
    """``(labels, files, source)``: one readable record per rank, in rank order."""
    if isinstance(dumps, (str, os.PathLike)):
        directory = os.fspath(dumps)
        if nranks is None:
            raise DumpError("nranks: required by check (the number of rank files to read)")
        paths = rank_files(directory, nranks)
        files = []
        try:
            for path in paths:
                files.append(DumpFile(path))
        except DumpError:
            for f in files:
                f.close()
            raise
        return paths, files, directory
    if isinstance(dumps, (Mapping, bytes, bytearray)) or not isinstance(dumps, Iterable):
        raise DumpError(f"dumps: expected a directory, or a list with one .npz path or dict "
                        f"of arrays per rank, got {type(dumps).__name__}")
    items = list(dumps)
    if not items:
        raise DumpError("dumps: empty list (expected one .npz path or dict per rank)")
    if nranks is not None and len(items) != nranks:
        raise DumpError(f"dumps: {len(items)} rank record(s) given, but the spec says nranks="
                        f"{nranks}")
    labels, files = [], []
    try:
        for r, item in enumerate(items):
            if isinstance(item, Mapping):
                labels.append(f"rank {r} (in memory)")
                files.append(_MemoryDump(item, labels[-1]))
            elif isinstance(item, (str, os.PathLike)):
                labels.append(os.fspath(item))
                if not os.path.isfile(labels[-1]):
                    raise DumpError(f"{labels[-1]}: missing (rank {r}'s dump)")
                files.append(DumpFile(labels[-1]))
            else:
                raise DumpError(f"dumps[{r}]: expected a .npz path or a dict of arrays, got "
                                f"{type(item).__name__}")
    except DumpError:
        for f in files:
            f.close()
        raise
    kinds = {type(f) for f in files}
    source = (f"{len(items)} in-memory rank record(s)" if kinds == {_MemoryDump}
              else ", ".join(labels) if len(labels) <= 3 else f"{labels[0]} ... {labels[-1]}")
    return labels, files, source


def _read_range(f: Any, label: str, key: str, numel: int) -> Optional[tuple]:
    """``[begin, end)`` of ``range/{name}``: two ints with ``0 <= begin <= end <= numel``."""
    if key not in f:
        return None
    begin, end = _int_pair(f, label, key)
    if not 0 <= begin <= end <= numel:
        raise DumpError(f"{label}: {key}: [{begin}, {end}) is not within [0, {numel}) of the "
                        f"flattened param (expected 0 <= begin <= end <= {numel})")
    return begin, end


def _coverage(name: str, what: str, pieces: dict, numel: int) -> list:
    """Gaps and overlaps of ``{rank: (begin, end)}`` over ``[0, numel)``."""
    events = sorted({0, numel, *(b for b, e in pieces.values() if b < e),
                     *(e for b, e in pieces.values() if b < e)})
    issues: list = []
    for lo, hi in zip(events, events[1:]):
        holders = tuple(r for r, (b, e) in sorted(pieces.items()) if b <= lo and hi <= e)
        kind = "gap" if not holders else "overlap" if len(holders) > 1 else None
        if kind is None:
            continue
        last = issues[-1] if issues else None
        if last is not None and last.kind == kind and last.end == lo and last.ranks == holders:
            issues[-1] = CoverageIssue(name, what, kind, last.begin, hi, holders)
        else:
            issues.append(CoverageIssue(name, what, kind, lo, hi, holders))
    return issues


class _PaddleSlices:
    """Paddle's reduce-scatter cut (``build_reduce_scatter_buffer``), planned once, lazily."""

    def __init__(self, spec: Any, nranks: int) -> None:
        self._spec, self._nranks, self._slots = spec, nranks, None

    def piece(self, name: str, rank: int) -> Optional[tuple]:
        """``(lo, hi)`` of the param's padded slot held by ``rank`` (``hi`` may pass numel:
        padding), or None."""
        if self._slots is None:
            self._slots = {p.name: buf.layout for buf in self._spec.plan(self._nranks)
                           for p in buf.params}
        lay = self._slots[name]
        piece = lay.slice_of(name, rank)
        if not piece:
            return None
        slot = lay[name]
        return piece[0] - slot.offset, piece[1] - slot.offset


# --------------------------------------------------------------------------- check


def check(spec: Any, dumps: DumpsLike, *, reduce_avg: bool = False,
          exact: bool = False) -> CheckReport:
    """Check another implementation's dump against the exact reference recomputed from its
    own inputs (each element's sum or mean, rounded once to the grad dtype), and its param
    all-gather bit-exact.

    ``spec``: a :class:`~mpifusion.spec.Spec`, a dict or a JSON spec path. ``dumps``: a
    directory of ``rank{r}.npz``, or a list (rank order) of ``.npz`` paths or dicts of arrays;
    ``mpifusion.oracle.check`` checks a directory of ``step{k}/`` folders step by step
    (:func:`~mpifusion.oracle.check_steps`, which returns a
    :class:`~mpifusion.oracle.StepsReport`).
    ``reduce_avg``: the implementation averaged inside the collective (Paddle's
    ``use_reduce_avg``), so non-root ranks of ``reduce`` keep their unscaled local sum.
    ``exact``: the inputs are exact in every order (:func:`~mpifusion.oracle.exact_inputs`;
    refused otherwise), so the result must match bit for bit (a non-power-of-two mean: its
    rounding). Bad input raises ``DumpError``/``SpecError`` (one line naming the file or rank
    and key); a mismatch does not raise: see ``report.ok`` and ``report.raise_for_failure()``.

    Args:
        spec: as above.
        dumps: as above.
        reduce_avg: as above.
        exact: as above.

    Returns:
        A :class:`~mpifusion.oracle.CheckReport` (a :class:`~mpifusion.oracle.StepsReport`
        for a directory of steps).

    Raises:
        DumpError: dumps that cannot be read or do not fit the spec.
        SpecError: an invalid spec.
    """
    import dataclasses

    if not isinstance(reduce_avg, (bool, np.bool_)):
        raise DumpError(f"reduce_avg: expected True or False, got {reduce_avg!r}")
    if not isinstance(exact, (bool, np.bool_)):
        raise DumpError(f"exact: expected True or False, got {exact!r}")
    spec = as_spec(spec)
    labels, files, source = _open_dumps(dumps, spec.nranks)
    try:
        if spec.nranks is None:  # a list of records: one rank each
            spec = dataclasses.replace(spec, nranks=len(files))
        return _check(spec, len(files), labels, files, source, bool(reduce_avg), bool(exact))
    finally:
        for f in files:
            f.close()


def check_dump(spec: Any, directory: str) -> CheckReport:
    """``check`` of a directory (kept for callers of the first API).

    Args:
        spec: a :class:`~mpifusion.spec.Spec`, a dict or a JSON spec path.
        directory: a folder of ``rank{r}.npz``.
    """
    return check(spec, directory)


def _check(spec: Any, nranks: int, labels: list, files: list, source: str,
           reduce_avg: bool, exact: bool = False) -> CheckReport:
    act, acc = spec.act, spec.acc_steps
    keys = [set(f.files) for f in files]
    has_inputs = any(k.startswith("in/") for ks in keys for k in ks)
    has_sync = any(k.startswith(("shard/", "param/")) for ks in keys for k in ks)
    if not has_inputs and not has_sync:
        raise DumpError(f"{labels[0]}: no in/{{name}}/{{k}} (gradients) nor shard/ and param/ "
                        f"(all-gather) keys: nothing to check")
    _check_keys(spec, acc, labels, keys)
    fused = spec.fused_params()
    if not fused:
        raise DumpError("spec: no param is fused (every one has stop_gradient or trainable "
                        "false): nothing to check")
    _check_aliasing(labels, files)
    slices = _PaddleSlices(spec, nranks)
    report = CheckReport([], {}, spec=spec, source=source, reduce_avg=reduce_avg, exact=exact)
    for p in fused:
        ranges = [_read_range(f, lab, f"range/{p.name}", p.numel) for f, lab in zip(files, labels)]
        if has_inputs:
            _check_grads(report, p, spec, nranks, acc, act, labels, files, ranges, slices,
                         reduce_avg)
        if any(f"shard/{p.name}" in ks or f"param/{p.name}" in ks for ks in keys):
            _check_gather(report, p, act, labels, files, ranges, slices)
    if not report.stats and not report.sync:
        raise DumpError(f"{labels[0]}: no key of a fused param of the spec (in/{{name}}/{{k}}, "
                        f"shard/ or param/): nothing to check")
    unfused = sorted({key for ks in keys for key in ks
                      if key.partition("/")[0] in _PREFIXES
                      and _key_param(key) not in {p.name for p in fused}})
    if unfused:
        report.notes.append(f"not checked: {len(unfused)} key(s) of params the spec does not "
                            f"fuse (stop_gradient or trainable false): "
                            f"{', '.join(unfused[:6])}{' ...' if len(unfused) > 6 else ''}")
    # per (rank, micro-step) input, not on average: one small input among large ones too
    coarse_dtypes = {c.partition(" grads:")[0] for c in report.coarse}
    grad_dtypes = {p.name: dtype_name(grad_dtype_for(p.dtype, spec.use_main_grad))
                   for p in fused}
    for what, names in report.unseen.items():
        where = f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
        one = "," not in what and " and " not in what
        whose = "its" if one else "each one's"
        report.notes.append(f"a lost {what} could not be seen here ({where}: "
                            f"{whose} share of the result is within "
                            f"the bound on every element): use exact inputs "
                            f"(mpifusion.oracle.exact_inputs, check --exact)")
        if any(grad_dtypes[n] not in coarse_dtypes for n in names):  # else: already warned
            report.coarse.append(f"{where}: the input of {what} is within the bound on every "
                                 f"element" if one else f"{where}: the inputs of {what} are "
                                 f"each within the bound on every element")
    if not has_inputs:  # an all-gather-only dump: results there is no reference for
        outs = sorted({key for ks in keys for key in ks if key.startswith("out/")
                       and _key_param(key) in {p.name for p in fused}})
        if outs:
            report.notes.append(f"not checked: {len(outs)} out/ key(s), since the dump holds "
                                f"no in/{{name}}/{{k}} inputs to compute the reference from: "
                                f"{', '.join(outs[:6])}{' ...' if len(outs) > 6 else ''}")
    return report


def _check_representable(x: np.ndarray, grad_dtype: str, where: str) -> None:
    """Inputs are the grads the implementation received, so each is a value of its grad
    dtype. One that is not (float64 values recorded for a float32 param, say) has no
    right answer to compare with: the implementation rounded what the reference did not,
    and a correct result would fail with a misleading excess."""
    if grad_dtype == "float64" or not x.size:
        return
    with np.errstate(over="ignore", invalid="ignore"):
        back = x.astype(as_dtype(grad_dtype)).astype(np.float64)
    bad = ~((back == x) | (np.isnan(back) & np.isnan(x)))
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        raise DumpError(f"{where}: {int(bad.sum())} value(s) not representable in {grad_dtype}, "
                        f"the grad dtype of the spec (first at flat index {i}: "
                        f"{float(x.reshape(-1)[i])!r}); expected the grads the implementation "
                        f"received, recorded in that dtype")


#: elements per ErrorStats.update: its float64 temporaries stay a few MiB, not the param's
_COMPARE_CHUNK = 1 << 20


def _bound_over_absolute(exact: Any, **model: Any) -> np.ndarray:
    """:func:`~.bound.error_bound` of every element, written over ``exact.absolute`` a chunk
    at a time: sum|x| is not needed once it is in the bound, and each is one of the param's
    largest arrays."""
    bound = exact.absolute
    for lo in range(0, bound.size, _COMPARE_CHUNK):
        hi = lo + _COMPARE_CHUNK
        bound[lo:hi] = error_bound(bound[lo:hi], ref_error=exact.error_of(lo, hi), **model)
    return bound


def _read_grad(f: Any, lab: str, key: str, p: Any, grad_dtype: str) -> np.ndarray:
    """An input as a flat array of its grad dtype (zeros where a frozen param has none):
    in that dtype, not float64 (no copy when stored so). A wider storage must hold values
    of the grad dtype."""
    x = read_array(f, lab, key, p.shape, p.dtype, missing_ok=p.stop_gradient, native=True)
    want = as_dtype(grad_dtype)
    if x is None:
        return np.zeros(p.numel, dtype=want)
    if x.dtype != want:
        _check_representable(x.astype(np.float64), grad_dtype, f"{lab}: {key}")
        x = x.astype(want)
    return x.reshape(-1)


def _key_param(key: str) -> str:
    """The param a dump-format key names (``in/{name}/{k}``, ``out/{name}``, ...)."""
    prefix, _, rest = key.partition("/")
    return rest.rpartition("/")[0] if prefix == "in" else rest


def _check_aliasing(labels: list, files: list) -> None:
    """In-memory records whose inputs share memory with a result: an in-place collective
    (or a dumper handing views of its grad buffer) rewrote the inputs, so the reference
    would be recomputed from the result and a wrong result could pass. Refused."""
    inputs, results = [], []
    for lab, f in zip(labels, files):
        if not isinstance(f, _MemoryDump):
            continue
        for key in f.files:
            if not key.startswith(_PREFIXES_SLASH):
                continue  # the dumper's own keys: never read
            # as numpy reads it: a torch tensor, a memoryview or any other array-like may
            # share the result's memory as well (looking at ndarrays only, an in-place
            # sum-instead-of-mean would pass with torch tensors)
            try:
                value = f[key]
            except DumpError:
                continue  # not an array: refused where it is read (or not checked)
            (inputs if key.startswith("in/") else results).append((lab, key, value))
    for (lab, key, x), (olab, okey, y) in _overlapping(inputs, results):
        if _shares(x, y):
            raise DumpError(f"{lab}: {key}: shares memory with {okey} of {olab}: the "
                                f"reference would be recomputed from the result (an in-place "
                                f"reduction overwrote the input); pass copies of the inputs "
                                f"taken before the sync")


try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds  # numpy >= 2
except ImportError:  # pragma: no cover - numpy 1.x
    _byte_bounds = np.byte_bounds


def _byte_range(a: np.ndarray) -> tuple:
    lo, hi = _byte_bounds(a)
    return lo, max(hi, lo)


def _overlapping(xs: list, ys: list) -> Iterable:
    """Pairs ``(x, y)`` of ``(label, key, array)`` whose memory spans overlap, found by one
    sort of the spans (every pair would be quadratic in the number of arrays)."""
    spans = sorted([(*_byte_range(t[2]), 0, i) for i, t in enumerate(xs) if t[2].size]
                   + [(*_byte_range(t[2]), 1, i) for i, t in enumerate(ys) if t[2].size])
    open_: list = [[], []]  # per side: (end, index) of spans still open
    for lo, hi, side, i in spans:
        for k in (0, 1):
            open_[k] = [(end, j) for end, j in open_[k] if end > lo]
        for _end, j in open_[1 - side]:
            yield (xs[i], ys[j]) if side == 0 else (xs[j], ys[i])
        open_[side].append((hi, i))


def _shares(x: np.ndarray, y: np.ndarray) -> bool:
    try:
        return bool(np.shares_memory(x, y, max_work=1 << 16))
    except np.exceptions.TooHardError:
        return True


#: key prefixes of the dump format; keys under other prefixes are the dumper's own
_PREFIXES = ("in", "out", "range", "shard", "param")
_PREFIXES_SLASH = tuple(f"{p}/" for p in _PREFIXES)


def _check_keys(spec: Any, acc: int, labels: list, keys: list) -> None:
    """Every key of the dump format must be one the spec expects: ``in/{name}/{k}`` with
    ``0 <= k < acc_steps`` and ``out/``, ``range/``, ``shard/``, ``param/`` of a spec param.
    A micro-step beyond ``acc_steps`` would otherwise be left out of the reference, so an
    implementation that dropped it would pass; a param the spec lacks would go unchecked."""
    names = {p.name for p in spec.params}
    fused = {p.name for p in spec.fused_params()}
    for lab, ks in zip(labels, keys):
        for key in sorted(ks):
            prefix, sep, rest = key.partition("/")
            if not sep or prefix not in _PREFIXES:
                continue
            name = rest
            if prefix == "in":
                name, sep, k = rest.rpartition("/")
                if not sep or not name:
                    raise DumpError(f"{lab}: {key}: expected in/{{name}}/{{k}} (k the "
                                    f"micro-step, 0 .. acc_steps-1)")
            if name not in names:
                shown = ", ".join(sorted(names)[:8]) + (" ..." if len(names) > 8 else "")
                raise DumpError(f"{lab}: {key}: no param {name!r} in the spec (its params: "
                                f"{shown}); give the spec every param the dump holds")
            if prefix == "in" and name in fused:
                # ASCII digits only: '\u00b2'.isdigit() is True but int() refuses it, and
                # int() refuses 4300+ digits (either would end in a traceback, not a DumpError)
                short = k if len(k) <= 24 else f"{k[:21]}..."
                where = f"{lab}: in/{name}/{short}"
                if not re.fullmatch(r"0|[1-9][0-9]*", k, flags=re.ASCII):
                    raise DumpError(f"{where}: micro-step {short!r}: expected an int k in "
                                    f"0 .. {acc - 1} (in/{name}/0 .. in/{name}/{acc - 1})")
                if len(k) > len(str(acc)) or int(k) >= acc:
                    raise DumpError(f"{where}: micro-step {short}, but the spec says "
                                    f"acc_steps={acc} (expected in/{name}/0 .. "
                                    f"in/{name}/{acc - 1}); a micro-step the spec leaves out "
                                    f"would not be in the reference")


def _check_grads(report: CheckReport, p: Any, spec: Any, nranks: int, acc: int, act: str,
                 labels: list, files: list, ranges: list, slices: _PaddleSlices,
                 reduce_avg: bool) -> None:
    grad_dtype = dtype_name(grad_dtype_for(p.dtype, spec.use_main_grad))
    if report.exact:  # exact inputs: no rounding bound, no note on its coarseness
        report.bounds[grad_dtype] = exact_formula(grad_dtype, nranks=nranks,
                                                  average=spec.average, prescaled=not reduce_avg)
    elif grad_dtype not in report.bounds:
        model = bound_model(grad_dtype=grad_dtype, nranks=nranks, acc_steps=acc,
                            average=spec.average, exact_reference=True)
        report.bounds[grad_dtype] = model.formula
        if model.rel * nranks * acc >= 1:
            report.notes.append(
                f"{grad_dtype} grads: the bound allows {model.rel:.3g} of sum|x| per element, "
                f"more than one of the {nranks * acc} inputs (ranks x micro-steps) adds on "
                f"average: a result missing one rank's or one micro-step's gradient may pass")
            report.coarse.append(
                f"{grad_dtype} grads: the bound ({model.rel:.3g} of sum|x|) is coarser than one "
                f"of the {nranks * acc} inputs adds on average")
    # the exact reference, streamed: one rank's input at a time into running sums, so
    # memory follows one param's reference, not every rank's inputs of it
    key = f"out/{p.name}"
    if act == "reduce":
        for lab, f, rng in zip(labels, files, ranges):
            if rng is not None and key in f:
                raise DumpError(f"{lab}: range/{p.name}: counts for out/ under act "
                                f"reduce_scatter or all_reduce (a rank's piece of the reduced "
                                f"gradient), not reduce, whose root holds the whole: give "
                                f"out/{p.name} shaped {list(p.shape)} and no range/{p.name}")
    own_ranks = ([r for r, f in enumerate(files) if r != spec.dst and key in f]
                 if act == "reduce" else [])
    results: dict = {}  # rank -> its ErrorStats, merged in rank order at the end
    seen: dict = {}  # failing rank -> (out, expected, bound, offset): for the diagnosis
    twins: dict = {}  # (offset, dtype, size, digest of its bytes) -> a failing output kept

    def fold(rank: int, out: np.ndarray, want: Optional[np.ndarray], tol: Optional[np.ndarray],
             over: np.ndarray, offset: int = 0, ref: Any = None) -> None:
        """Compare one rank's output; keep it for the diagnosis only when it fails (the
        same bytes as a failing output already kept: that array). ``want``/``tol`` None:
        the param's reference and bound at ``offset`` (the diagnosis slices them)."""
        e, b = ((want, tol) if want is not None
                else (ref[0][offset:offset + out.size], ref[1][offset:offset + out.size]))
        rs = ErrorStats(p.name)
        for lo in range(0, out.size, _COMPARE_CHUNK):  # chunks: bounded temporaries
            hi = lo + _COMPARE_CHUNK
            rs.update(out[lo:hi], e[lo:hi], b[lo:hi], rank, overflow=over[lo:hi],
                      offset=offset + lo)
        if rs.compared:
            results[rank] = rs
        if not rs.ok:
            digest = (offset, out.dtype.str, out.size,
                      hashlib.blake2b(_bytes_of(out), digest_size=16).digest())
            out = twins.setdefault(digest, out)
            seen[rank] = (out, want, tol, offset)

    # REDUCE off the root (Paddle's rule): each rank's own exact sum, first, so that it is
    # never held next to the param's reference
    scaled = spec.average and not reduce_avg
    for rank in own_ranks:
        lab, f = labels[rank], files[rank]
        out = read_array(f, lab, key, p.shape, p.dtype, missing_ok=True, native=True)
        if out is None:
            continue
        c = 1.0 / nranks if scaled else 1.0
        own = _stream_sum(p, grad_dtype, [(rank, lab, f)], acc, nranks if scaled else 1)
        if report.exact:  # its own exact sum, times 1/n: one product's rounding
            tol = exact_tolerance(own.value, own.absolute, grad_dtype=grad_dtype,
                                  nranks=nranks, average=scaled, prescaled=False) + own.error
        else:
            tol = own.absolute
            for lo in range(0, tol.size, _COMPARE_CHUNK):  # written over sum|x|, by chunks
                hi = lo + _COMPARE_CHUNK
                tol[lo:hi] = error_bound(tol[lo:hi] * c, grad_dtype=grad_dtype, nranks=1,
                                         acc_steps=acc, average=scaled,
                                         ref_error=own.error_of(lo, hi))
        fold(rank, out.reshape(-1), own.value, tol.reshape(-1), own.overflow)
        out = own = tol = None  # type: ignore[assignment]

    digests: list = []  # per rank: its inputs' bytes, hashed (are all ranks' inputs the same?)
    exact_in = (ExactInputCheck(p.name, p.numel, grad_dtype, nranks, spec.average)
                if report.exact else None)  # are the inputs exact in every order?
    # the exact sum (mean) rounded once to the grad dtype; its rounding goes into the bound
    peaks: Optional[dict] = None if report.exact else {}  # (rank, k) -> max |input|
    exact = _stream_sum(p, grad_dtype, list(zip(range(nranks), labels, files)), acc,
                        nranks if spec.average else 1, digests, exact_in, peaks)
    ref, absolute, overflow = exact.value, exact.absolute, exact.overflow
    if exact_in is not None:
        exact_in.verify(absolute)
        exact_in = None
    if p.numel and not np.any(absolute):
        report.notes.append(f"{p.name}: every input is 0, so a result left at 0 without any "
                            f"reduction passes too")
        report.weak.append(f"{p.name}: every input is 0")
    elif nranks > 1 and p.numel and len(set(digests)) == 1:
        report.notes.append(
            f"{p.name}: every rank fed the same inputs"
            + (", so the mean equals each rank's own gradient: a result that skipped the "
               "reduction passes too" if spec.average else "")
            + "; inputs recorded after a reduction (a hook ahead of the capture's) look the "
              "same, and then any reduction passes")
        if spec.average:  # a sum of the same inputs still shows a missing reduction (x, not n*x)
            report.weak.append(f"{p.name}: every rank fed the same inputs")
    if report.exact:  # 0, or the rounding of a mean over a non-power-of-two rank count
        bound = exact_tolerance(ref, absolute, grad_dtype=grad_dtype, nranks=nranks,
                                average=spec.average, prescaled=not reduce_avg) + exact.error
    else:
        bound = _bound_over_absolute(exact, grad_dtype=grad_dtype, nranks=nranks,
                                     acc_steps=acc, average=spec.average)
    if peaks and np.any(absolute):  # a contribution whose loss the bound cannot see
        hidden = _unseen_inputs(p, grad_dtype, labels, files, peaks, bound,
                                1.0 / nranks if spec.average else 1.0)
        if hidden:
            report.unseen.setdefault(_describe_inputs(hidden, acc), []).append(p.name)
    absolute = exact = None  # type: ignore[assignment]  # only ref, overflow, bound from here
    stats = ErrorStats(p.name)
    per_rank: dict = {}
    ref_flat, bound_flat = ref.reshape(-1), bound.reshape(-1)
    both = (ref_flat, bound_flat)
    # range/: a rank's piece of the reduced gradient (reduce_scatter, or an all_reduce whose
    # result each rank keeps a shard of: Megatron's distributed optimizer); the root of a
    # reduce holds the whole
    use_ranges = act != "reduce" and any(r is not None for r in ranges)
    pieces: dict = {}
    if use_ranges:
        for lab, f, rng in zip(labels, files, ranges):
            if rng is None and key in f:
                given = next(r for r, g in enumerate(ranges) if g is not None)
                raise DumpError(f"{lab}: range/{p.name}: missing (out/{p.name} is given and "
                                f"rank {given} gives a range: every rank that holds a piece "
                                f"gives its [begin, end))")

    for rank, (lab, f) in enumerate(zip(labels, files)):
        if (act == "all_reduce" and not use_ranges) or (act == "reduce" and rank == spec.dst):
            out = read_array(f, lab, key, p.shape, p.dtype, native=True)
            fold(rank, out.reshape(-1), None, None, overflow, ref=both)
        elif act == "reduce":
            continue  # off the root: compared above, against the rank's own sum
        elif use_ranges:  # reduce_scatter or all_reduce: each rank's [begin, end)
            rng = ranges[rank]
            if rng is None:
                continue
            begin, end = rng
            pieces[rank] = rng
            out = read_array(f, lab, key, (end - begin,), p.dtype, missing_ok=begin == end,
                             native=True)
            if out is not None and end > begin:
                fold(rank, out, None, None, overflow[begin:end], begin, ref=both)
        else:  # reduce_scatter, Paddle's cut: a slice of the padded slot (padding must be 0)
            piece = slices.piece(p.name, rank)
            lo, hi = piece if piece else (0, 0)
            out = read_array(f, lab, key, (hi - lo,), p.dtype, missing_ok=not piece,
                             native=True)
            if out is None or not piece:
                continue
            fold(rank, out, _padded(ref_flat, lo, hi), _padded(bound_flat, lo, hi),
                 _padded(overflow, lo, hi), lo)
        out = None  # type: ignore[assignment]
    for rank in sorted(results):  # rank order, as the report names the first failure
        per_rank[rank] = results[rank]
        stats.merge(results[rank])
    if use_ranges:
        report.ranged.append(p.name)
        report.coverage.extend(_coverage(p.name, "out", pieces, p.numel))
    report.stats.append(stats)
    report.rank_stats[p.name] = per_rank
    if not stats.ok:  # what most likely went wrong (advice only: the verdict stands)
        # the inputs again (they were dropped once summed): only for a failing param
        inputs = [[_read_grad(f, lab, f"in/{p.name}/{k}", p, grad_dtype) for k in range(acc)]
                  for lab, f in zip(labels, files)]
        report.diagnoses[p.name] = diagnose_failure(p, spec, nranks, reduce_avg, ref_flat,
                                                    bound_flat, inputs, seen, per_rank, labels,
                                                    files)


def _unseen_inputs(p: Any, grad_dtype: str, labels: list, files: list, peaks: dict,
                   bound: np.ndarray, weight: float) -> list:
    """``(rank, k)`` of every input whose loss the bound cannot see: its share of the result
    (``weight * |x|``) within the bound on every element, so a result missing it passes.
    Only inputs whose largest element is within the largest bound are read again."""
    flat = bound.reshape(-1)
    top = float(np.max(flat)) if flat.size else 0.0
    hidden = []
    for (rank, k), peak in sorted(peaks.items()):
        if not weight * peak <= top:  # beyond every element's bound somewhere (or NaN): seen
            continue
        x = _read_grad(files[rank], labels[rank], f"in/{p.name}/{k}", p, grad_dtype)
        x = x.reshape(-1)
        if all(np.all(weight * np.abs(x[lo:lo + _COMPARE_CHUNK].astype(np.float64))
                      <= flat[lo:lo + _COMPARE_CHUNK])
               for lo in range(0, x.size, _COMPARE_CHUNK)):
            hidden.append((rank, k))
        x = None  # type: ignore[assignment]
    return hidden


def _describe_inputs(hidden: list, acc: int) -> str:
    """``rank 1``, ``rank 0 micro-step 1`` ...: the inputs ``hidden`` (a rank whose every
    micro-step is hidden is named alone)."""
    by_rank: dict = {}
    for rank, k in hidden:
        by_rank.setdefault(rank, []).append(k)
    parts = []
    for rank, ks in sorted(by_rank.items()):
        if len(ks) == acc:
            parts.append(f"rank {rank}")
        else:
            parts.extend(f"rank {rank} micro-step {k}" for k in ks)
    return ", ".join(parts[:6]) + (f" and {len(parts) - 6} more" if len(parts) > 6 else "")


def _bytes_of(x: np.ndarray) -> Any:
    """``x``'s bytes, without a copy when it is contiguous (for a digest)."""
    x = np.ascontiguousarray(x)
    return x.view(np.uint8) if x.size else b""


def _padded(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``x[lo:hi]`` with zeros past its end (Paddle's padding), only that piece copied."""
    if hi <= x.size:
        return x[lo:hi]
    part = x[min(lo, x.size):]
    return np.concatenate([part, np.zeros(hi - max(lo, x.size), dtype=x.dtype)])


def _stream_sum(p: Any, grad_dtype: str, ranks: list, acc: int, divisor: int,
                digests: Optional[list] = None, exact_in: Any = None,
                peaks: Optional[dict] = None) -> Any:
    """The exact ``sum / divisor`` of the inputs of ``ranks`` (``(rank, label, file)``),
    read one at a time and dropped once added (:class:`~.exact.ExactStream`); elements
    that need the integer path read them again. ``digests`` gets each rank's inputs'
    digest, ``exact_in`` each input, ``peaks[(rank, k)]`` each input's max ``|x|``."""
    stream = ExactStream(p.numel)
    for _rank, lab, f in ranks:
        digest = hashlib.blake2b(digest_size=16)
        for k in range(acc):
            x = _read_grad(f, lab, f"in/{p.name}/{k}", p, grad_dtype)
            if digests is not None:
                digest.update(_bytes_of(x))
            if peaks is not None:
                with np.errstate(invalid="ignore"):
                    peaks[(_rank, k)] = float(np.max(np.abs(x))) if x.size else 0.0
            if exact_in is not None:
                exact_in.add(x, f"{lab}: in/{p.name}/{k}")
            stream.add(x)
            x = None  # type: ignore[assignment]
        if digests is not None:
            digests.append(digest.digest())

    def again() -> Iterable:
        for _rank, lab, f in ranks:
            for k in range(acc):
                yield _read_grad(f, lab, f"in/{p.name}/{k}", p, grad_dtype)

    return stream.result(grad_dtype, divisor, again, native=True)


def _bits_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: not the same number (NaN equals NaN; -0 differs from +0)."""
    same = (a == b) & (np.signbit(a) == np.signbit(b))
    return ~(same | (np.isnan(a) & np.isnan(b)))


def _check_gather(report: CheckReport, p: Any, act: str, labels: list, files: list,
                  ranges: list, slices: _PaddleSlices) -> None:
    numel = p.numel
    expected = np.zeros(numel)
    covered = np.zeros(numel, dtype=bool)
    stats = SyncStats(p.name)
    pieces: dict = {}
    given = False  # a shard on some rank, even one holding no element of the param
    for rank, (lab, f) in enumerate(zip(labels, files)):
        key = f"shard/{p.name}"
        if key not in f:
            continue
        given = True
        rng = ranges[rank]
        if rng is not None:
            lo, hi = rng
        elif act == "reduce_scatter":
            piece = slices.piece(p.name, rank)
            lo, hi = piece if piece else (0, 0)
        else:
            raise DumpError(f"{lab}: range/{p.name}: missing (shard/{p.name} needs the "
                            f"[begin, end) it covers; act {act} has no default cut)")
        shard = read_array(f, lab, key, (hi - lo,), p.dtype)
        hi_in = min(hi, numel)  # Paddle's cut may run into padding: not part of the param
        if hi_in <= lo:
            continue
        shard = shard[:hi_in - lo]
        pieces[rank] = (lo, hi_in)
        seen = covered[lo:hi_in]
        stats.conflicts += int(np.count_nonzero(
            seen & _bits_differ(expected[lo:hi_in], shard)))
        expected[lo:hi_in] = np.where(seen, expected[lo:hi_in], shard)
        covered[lo:hi_in] = True
    if not given:  # shards holding no element (a 0-element param, padding) are a gap at most
        raise DumpError(f"{labels[0]}: shard/{p.name}: missing on every rank (param/{p.name} "
                        f"is checked against the shards ranks held before the all-gather)")
    gathered = [(rank, lab, f) for rank, (lab, f) in enumerate(zip(labels, files))
                if f"param/{p.name}" in f]
    if not gathered:
        raise DumpError(f"{labels[0]}: param/{p.name}: missing on every rank (the full param "
                        f"after the all-gather, shaped {list(p.shape)})")
    for rank, lab, f in gathered:
        full = read_array(f, lab, f"param/{p.name}", p.shape, p.dtype).reshape(-1)
        bad = int(np.count_nonzero(covered & _bits_differ(full, expected)))
        stats.compared += int(np.count_nonzero(covered))
        if bad:
            stats.mismatched += bad
            stats.ranks.append(rank)
    report.coverage.extend(_coverage(p.name, "shard", pieces, numel))
    report.sync.append(stats)

