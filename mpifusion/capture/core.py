"""The framework-independent part of every capture adapter: one rank's dump being built."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..dtypes import as_dtype
from ..errors import FusionError

__all__ = ["CaptureError", "Recorder"]


class CaptureError(FusionError, ValueError):
    """A capture that cannot make a consistent dump (one line naming the rank and param)."""


def disagreement(summaries: list) -> str:
    """What makes the ranks' records unfit to gather (empty if nothing): each rank's own
    error, and every param whose recorded micro-steps differ between ranks. ``summaries`` is
    every rank's ``{"rank", "problem", "steps": {name: count}}``, in rank order; every rank
    computes the same text from the same list."""
    lines = [str(s["problem"]) for s in summaries if s.get("problem")]
    names: dict = {}
    for s in summaries:
        for name in s["steps"]:
            names.setdefault(name, None)
    uneven = []
    for name in names:
        counts = [int(s["steps"].get(name, 0)) for s in summaries]
        if len(set(counts)) <= 1:
            continue
        by_count: dict = {}
        for s, c in zip(summaries, counts):
            by_count.setdefault(c, []).append(str(s["rank"]))
        parts = [(f"no grad on rank(s) {', '.join(rs)} (unused there?)" if c == 0 else
                  f"{c} micro-step(s) on rank(s) {', '.join(rs)}")
                 for c, rs in sorted(by_count.items())]
        uneven.append(f"{name}: {'; '.join(parts)}")
    if uneven:
        lines.append(f"params recorded unlike on the ranks: {' | '.join(uneven[:8])}"
                     f"{' ...' if len(uneven) > 8 else ''} (expected every param's local grad "
                     f"on every rank in every micro-step: the oracle needs each rank's inputs)")
    return "; ".join(lines)


class Recorder:
    """One rank's dump being built: local grads per micro-step (``in/{name}/{k}``), what the
    rank holds after the sync (``out/{name}``, with ``range/{name}`` for a 1-D piece), and the
    param all-gather (``shard/{name}`` before, ``param/{name}`` after). Arrays are copied in as
    numpy (bfloat16 as ``ml_dtypes.bfloat16``), in the order params were declared.

    Args:
        rank: this rank (names the file, ``rank{r}.npz``).
        nranks: the number of ranks, for :meth:`spec` (it may be given there instead).

    Raises:
        CaptureError: a rank that is not an int >= 0.
    """

    def __init__(self, rank: int = 0, nranks: Optional[int] = None) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise CaptureError(f"rank: expected an int >= 0, got {rank!r}")
        self.rank, self.nranks = rank, nranks
        self._meta: dict = {}     # name -> (shape, dtype name), declaration order
        self._inputs: dict = {}   # name -> [array per micro-step]
        self._arrays: dict = {}   # out/, range/, shard/, param/ keys
        self._deferred: list = []  # errors of reading the sync's results, raised by to_dict
        self.step_label: Optional[int] = None  # set by step(k): save() writes step{k}/

    # ---------------------------------------------------------------- recording
    def declare(self, name: str, shape: Iterable[int], dtype: Any) -> None:
        """Name a param (global shape, param dtype): it appears in the spec in this order.

        Args:
            name: the param's name in the dump and the spec.
            shape: its global shape (not a shard's).
            dtype: its dtype (a name or a numpy dtype).

        Raises:
            CaptureError: ``name`` declared before with another shape or dtype.
        """
        entry = (tuple(int(s) for s in shape), as_dtype(dtype).name)
        old = self._meta.get(name)
        if old is not None and old != entry:
            raise CaptureError(f"rank {self.rank}: {name}: declared as {list(old[0])} {old[1]}"
                               f", now {list(entry[0])} {entry[1]}")
        self._meta[name] = entry
        self._inputs.setdefault(name, [])

    def _known(self, name: str) -> tuple:
        if name not in self._meta:
            raise CaptureError(f"rank {self.rank}: {name}: not a declared param (known: "
                               f"{', '.join(list(self._meta)[:8])}{' ...' if len(self._meta) > 8 else ''})")
        return self._meta[name]

    def add_input(self, name: str, grad: np.ndarray) -> None:
        """One micro-step's local gradient of ``name`` (param shape).

        Args:
            name: a declared param.
            grad: this rank's gradient before the sync (copied).

        Raises:
            CaptureError: an undeclared param, or a gradient of another shape.
        """
        shape, _ = self._known(name)
        grad = np.array(grad, copy=True)
        if grad.shape != shape:
            raise CaptureError(f"rank {self.rank}: {name}: local grad of shape "
                               f"{list(grad.shape)}, expected the param's {list(shape)}")
        self._inputs[name].append(grad)

    def set_output(self, name: str, value: np.ndarray,
                   range: Optional[tuple] = None) -> None:  # noqa: A002 - the dump's word
        """What the rank holds after the sync: the full grad, or (``range=(begin, end)`` of
        the flattened param) its 1-D piece.

        Args:
            name: a declared param.
            value: the synced gradient (copied).
            range: where the piece lies in the flattened param.

        Raises:
            CaptureError: an undeclared param, or a value that fits neither the param nor
                the range.
        """
        self._put("out", name, value, range)

    def set_shard(self, name: str, value: np.ndarray, range: Optional[tuple] = None) -> None:  # noqa: A002
        """The rank's param shard before the all-gather (1-D; ``range`` as in set_output;
        without it the checker cuts as Paddle's reduce-scatter buffer does).

        Args:
            name: a declared param.
            value: the shard (copied).
            range: as above.
        """
        self._put("shard", name, value, range)

    def set_param(self, name: str, value: np.ndarray) -> None:
        """The full param after the all-gather (param shape).

        Args:
            name: a declared param.
            value: the gathered param (copied).

        Raises:
            CaptureError: an undeclared param, or a value of another shape.
        """
        shape, _ = self._known(name)
        value = np.array(value, copy=True)
        if value.shape != shape:
            raise CaptureError(f"rank {self.rank}: {name}: gathered param of shape "
                               f"{list(value.shape)}, expected {list(shape)}")
        self._arrays[f"param/{name}"] = value

    def _put(self, kind: str, name: str, value: np.ndarray, rng: Optional[tuple]) -> None:
        shape, _ = self._known(name)
        value = np.array(value, copy=True)
        if rng is None:
            if kind == "out" and value.shape != shape and value.ndim != 1:
                raise CaptureError(f"rank {self.rank}: {name}: output of shape "
                                   f"{list(value.shape)}: expected the param's {list(shape)} "
                                   f"or a 1-D piece")
            self._arrays[f"{kind}/{name}"] = value if kind == "out" else value.reshape(-1)
            return
        begin, end = (int(rng[0]), int(rng[1]))
        numel = int(np.prod(shape))
        if not 0 <= begin <= end <= numel or value.size != end - begin:
            raise CaptureError(f"rank {self.rank}: {name}: {kind} range [{begin}, {end}) with "
                               f"{value.size} element(s); expected 0 <= begin <= end <= "
                               f"{numel} and end - begin elements")
        old = self._arrays.get(f"range/{name}")
        if old is not None and tuple(int(v) for v in old) != (begin, end):
            raise CaptureError(f"rank {self.rank}: {name}: range [{begin}, {end}) differs from "
                               f"the one recorded before {list(map(int, old))} (out/ and shard/"
                               f" share one range per param)")
        self._arrays[f"range/{name}"] = np.array([begin, end], dtype=np.int64)
        self._arrays[f"{kind}/{name}"] = value.reshape(-1)

    def _read_outputs(self, params: dict, attr: str, cleared_by: str,
                      store: Callable[[str, Any, Any], None]) -> None:
        """``store(name, param, grad)`` for each param given grads, its grad read from
        ``attr``. A grad that is gone (``cleared_by`` ran first) or refused is kept and
        raised by :meth:`to_dict`, hence by ``gather()`` on every rank: raised here, on the
        one rank that lacked it, it left its peers waiting in ``gather()`` for ever."""
        for name, p in params.items():
            if not self._inputs[name]:
                continue
            try:
                g = getattr(p, attr, None)
                if g is None:
                    raise CaptureError(f"rank {self.rank}: {name}: .{attr} is None after the "
                                       f"sync (call record_outputs before {cleared_by})")
                store(name, p, g)
            except CaptureError as e:
                self._deferred.append(str(e))

    def clear(self) -> None:
        """Forget everything recorded (the declared params stay): the next step starts over."""
        for xs in self._inputs.values():
            xs.clear()
        self._arrays.clear()
        self._deferred.clear()

    def step(self, k: int) -> "Recorder":
        """Start training step ``k`` (call it before the step's first forward): forget what was
        recorded (the declared params stay), and make :meth:`save` write
        ``directory/step{k}/rank{r}.npz``, which ``check`` reads step by step, naming the
        step that fails (and an accumulator not zeroed between steps). Returns self.

        Raises:
            CaptureError: ``k`` is not an int >= 0.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise CaptureError(f"rank {self.rank}: step: expected an int >= 0, got {k!r}")
        self.clear()
        self.step_label = k
        return self

    # ---------------------------------------------------------------- results
    @property
    def acc_steps(self) -> int:
        """Micro-steps recorded (the same for every param that received grads)."""
        counts = {n: len(xs) for n, xs in self._inputs.items() if xs}
        if not counts:
            return 0
        most = max(counts.values())
        short = [f"{n} ({c})" for n, c in counts.items() if c != most]
        if short:
            raise CaptureError(f"rank {self.rank}: params recorded different numbers of "
                               f"micro-steps: {most} for most, {', '.join(short[:8])} (one "
                               f"backward per micro-step, every param used in each)")
        return most

    def recorded(self) -> list:
        """Names of the params the dump covers (declared and given grads or gather arrays)."""
        return [n for n in self._meta
                if self._inputs[n] or f"param/{n}" in self._arrays or f"shard/{n}" in self._arrays]

    def to_dict(self) -> dict:
        """This rank's record in the dump format (``mpifusion.oracle.check`` takes a list of
        these, one per rank). Raises what reading the outputs found (see ``_read_outputs``)."""
        if self._deferred:
            raise CaptureError("; ".join(self._deferred))
        self.acc_steps  # noqa: B018 - raises on inconsistent micro-steps
        out = {f"in/{n}/{k}": x for n, xs in self._inputs.items() for k, x in enumerate(xs)}
        out.update(self._arrays)
        return out

    def _to_dict_agreed(self, all_gather: Callable[[Any], list]) -> dict:
        """:meth:`to_dict`, agreed on by every rank before any record is sent: each rank
        hands ``all_gather`` (a collective returning every rank's object, in rank order) its
        micro-step count per param and the error its own record raised, if any; then every
        rank raises the same :class:`CaptureError` when one rank's record is inconsistent or
        a param's count differs between ranks (unused on a rank: no grad reached its hook).
        Without this, the rank whose record raised left the others waiting in the gather's
        collective forever."""
        try:
            mine, problem = self.to_dict(), None
        except CaptureError as e:
            mine, problem = None, str(e)
        summary = {"rank": self.rank, "problem": problem,
                   "steps": {n: len(xs) for n, xs in self._inputs.items()}}
        found = disagreement(all_gather(summary))
        if found:
            raise CaptureError(f"rank {self.rank}: gather refused on every rank (no record "
                               f"was sent): {found}")
        return mine

    def save(self, directory: str) -> str:
        """Write ``rank{r}.npz`` into ``directory`` (``directory/step{k}/`` after
        :meth:`step`; bfloat16 as raw 2-byte values, which ``.npz`` can hold) and return its
        path.

        Raises:
            CaptureError: an inconsistent record (see :meth:`to_dict`).
        """
        if self.step_label is not None:
            directory = os.path.join(directory, f"step{self.step_label}")
        os.makedirs(directory, exist_ok=True)
        arrays = {}
        for key, arr in self.to_dict().items():
            arrays[key] = arr.view(np.uint16) if arr.dtype.kind == "V" and arr.dtype.itemsize == 2 \
                else arr
        path = os.path.join(directory, f"rank{self.rank}.npz")
        np.savez(path, **arrays)
        return path

    def spec(self, act: str = "all_reduce", *, average: bool = True,
             nranks: Optional[int] = None, **fields: Any) -> dict:
        """The spec of this dump (JSON-ready): the recorded params with their global shapes
        and dtypes, ``acc_steps`` as recorded, ``nranks`` (default: the capture's), and any
        other spec field (``dst``, ``use_main_grad``, ``group_size``).

        Args:
            act: the collective the dumps come from (``"all_reduce"``, ``"reduce"``,
                ``"reduce_scatter"``); ``"reduce"`` defaults ``dst`` to 0.
            average: whether the synced result is the mean over ranks.
            nranks: as above.
            fields: other spec fields, as above.

        Raises:
            CaptureError: ``nranks`` unknown, or nothing recorded yet.
        """
        nranks = nranks if nranks is not None else self.nranks
        if nranks is None:
            raise CaptureError("nranks: unknown (pass nranks= to the capture or to spec())")
        names = self.recorded()
        if not names:
            raise CaptureError(f"rank {self.rank}: nothing recorded yet (run a backward, or "
                               f"record params, before asking for the spec)")
        doc = {"params": [{"name": n, "shape": list(self._meta[n][0]), "dtype": self._meta[n][1]}
                          for n in names],
               "act": act, "nranks": int(nranks), "acc_steps": max(self.acc_steps, 1),
               "average": bool(average)}
        if act == "reduce" and "dst" not in fields:
            fields["dst"] = 0
        if getattr(self, "_attr", "grad") == "main_grad":
            # the outputs are fp32 main grads: without this the spec's half-precision grads
            # would give the check the looser half bound (under which a 0.2% error passes)
            fields.setdefault("use_main_grad", True)
        doc.update(fields)
        return doc

    def save_spec(self, path: str, act: str = "all_reduce", **kwargs: Any) -> str:
        """Write :meth:`spec` as JSON to ``path`` (for ``mpifusion check --spec``); ``act``
        and ``kwargs`` go to :meth:`spec`. Returns ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.spec(act, **kwargs), f, indent=1)
        return path
