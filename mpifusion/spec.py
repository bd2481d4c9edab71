"""JSON spec files for ``mpifusion layout --spec`` and ``mpifusion check --spec``.

A spec describes the parameters to fuse and how their gradients are
communicated.  Validation happens in the dataclasses themselves, so specs
built in Python or changed with ``dataclasses.replace`` are checked exactly
like ones read from disk, and every problem is a one-line ``SpecError``
naming the file and the offending field.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

from .dtypes import ALIAS_NAMES, ITEMSIZES
from .errors import FusionError
from .limits import MAX_INT, InputLimitError, loads_strict_json, read_text, shape_too_large
from .plan.actions import ACT_NAMES
from .plan.layout import FUSED_GROUP_SIZE

__all__ = [
    "ACTS",
    "DEFAULT_GROUP_SIZE",
    "DTYPE_ALIASES",
    "ITEMSIZE",
    "ParamSpec",
    "Spec",
    "SpecError",
    "load_spec",
    "normalize_dtype",
]

#: the values of a spec's ``act`` (``"all_reduce"``, ``"reduce"``, ``"reduce_scatter"``)
ACTS: tuple[str, ...] = ACT_NAMES
#: a spec's default ``group_size`` in bytes, ``fused_parameters``' default (256 MiB)
DEFAULT_GROUP_SIZE = FUSED_GROUP_SIZE

#: alias (fp16, bf16, double, ...) -> canonical name; the table of ``mpifusion.dtypes``
DTYPE_ALIASES: dict[str, str] = dict(ALIAS_NAMES)
#: canonical dtype name -> bytes per element
ITEMSIZE: dict[str, int] = dict(ITEMSIZES)

_Path = tuple[Any, ...]


class SpecError(FusionError, ValueError):
    """Invalid spec; ``source``, ``path`` and ``reason`` are kept for tools, ``str()`` is one line.

    Args:
        reason: what is wrong, one line (newlines are joined).
        path: where in the spec: keys and list indices, e.g. ``("params", 3, "dtype")``.
        source: the file (or ``"<spec dict>"``, ``"preset NAME"``) the spec came from.
    """

    def __init__(self, reason: str, path: _Path = (), source: str | None = None) -> None:
        self.reason, self.path, self.source = " ".join(str(reason).splitlines()), tuple(path), source
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in self.path).lstrip(".")
        super().__init__(": ".join(x for x in (source, loc, self.reason) if x))

    def within(self, *prefix: Any, source: str | None = None) -> SpecError:
        """Re-anchor an error raised by an inner object at its place in the file.

        Args:
            prefix: the keys and indices of the inner object, put before ``path``.
            source: the file to name instead of the error's own (None keeps it).

        Returns:
            A new :class:`SpecError`; this one is unchanged.
        """
        return SpecError(self.reason, (*prefix, *self.path), source if source is not None else self.source)


def _show(value: Any) -> str:
    """Render an offending value the way it looks in the JSON file, bounded in length."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(value)
        except Exception:  # a hostile __repr__ must not mask the real error
            text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_bool(v: Any, field: str) -> bool:
    # JSON 0/1 for a flag is usually a typo for an int field, so be strict.
    if not isinstance(v, bool):
        raise SpecError(f"expected true or false, got {_show(v)}", (field,))
    return v


def _check_int(v: Any, field: str, minimum: int) -> int:
    if not _is_int(v) or v < minimum:
        raise SpecError(f"expected an int >= {minimum}, got {_show(v)}", (field,))
    if v > MAX_INT:
        raise SpecError(f"expected an int <= 2**63-1, got {_show(v)}", (field,))
    return int(v)


def normalize_dtype(dtype: Any, field: str = "dtype") -> str:
    """Map dtype aliases (fp16, bf16, double, ...) to one numpy-style name.

    Args:
        dtype: a dtype name or alias, any case.
        field: the spec field to name in the error.

    Returns:
        The canonical name (``"float16"``, ``"bfloat16"``, ...).

    Raises:
        SpecError: an unknown dtype (the message lists the known ones).
    """
    canon = DTYPE_ALIASES.get(dtype.lower()) if isinstance(dtype, str) else None
    if canon is None:
        names = ", ".join(sorted(set(DTYPE_ALIASES.values())))
        raise SpecError(f"unknown dtype {_show(dtype)}; expected one of {names} (or an alias such as fp16, bf16)",
                        (field,))
    return canon


def _check_keys(d: Mapping, allowed: tuple[str, ...], required: tuple[str, ...], path: _Path) -> None:
    for key in d:
        if key not in allowed:
            hint = difflib.get_close_matches(key, allowed, n=1) if isinstance(key, str) else []
            extra = f" (did you mean {_show(hint[0])}?)" if hint else f" (allowed: {', '.join(allowed)})"
            raise SpecError(f"unknown key {_show(key)}{extra}", path)
    for key in required:
        if key not in d:
            raise SpecError(f"missing required key {_show(key)}", path)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter; the flags mirror the Paddle attributes that decide fusion membership.

    Raises:
        SpecError: a field with a value it cannot take.
    """

    #: the param's name, unique in the spec (printable characters only)
    name: str
    #: the param's shape (non-negative ints)
    shape: tuple[int, ...]
    #: the param's dtype, a name or alias (:func:`normalize_dtype`)
    dtype: str = "float32"
    #: Paddle's ``trainable``; False leaves the param out of the buffers
    trainable: bool = True
    #: Paddle's ``stop_gradient``; True leaves the param out of the buffers
    stop_gradient: bool = False
    #: Paddle's ``is_distributed`` (a model-parallel param), split apart by ``fused_parameters``
    is_distributed: bool = False
    #: Paddle's ``need_clip``, split apart by ``fused_parameters``
    need_clip: bool = True
    #: whether weight decay applies (what ``apply_decay_param_fun`` would say)
    decay: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"expected a non-empty string, got {_show(self.name)}", ("name",))
        if not self.name.isprintable():
            # a newline or terminal escape in a name can forge lines of a report (a FAIL whose
            # last line reads "PASS ..."); no framework names a param that way
            raise SpecError(f"expected printable characters only, got {_show(self.name)}",
                            ("name",))
        shape = self.shape
        if not isinstance(shape, (list, tuple)) or not all(_is_int(s) and s >= 0 for s in shape):
            raise SpecError(f"expected a list of non-negative ints, got {_show(shape)}", ("shape",))
        if shape_too_large(shape):  # numpy's limits (ndim, bytes of a float64 copy)
            raise SpecError(f"expected at most 64 dims and 2**59 elements (zero dims count as "
                            f"1), got {_show(shape)}", ("shape",))
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        for flag in ("trainable", "stop_gradient", "is_distributed", "need_clip", "decay"):
            _check_bool(getattr(self, flag), flag)

    @property
    def numel(self) -> int:
        """Elements of the param (the product of its shape)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the param in its dtype (unpadded)."""
        return self.numel * ITEMSIZE[self.dtype]

    @classmethod
    def from_dict(cls, d: Any) -> ParamSpec:
        """Build from a JSON object; errors carry a path relative to this entry.

        Args:
            d: the entry's dict (``name``, ``shape`` and ``dtype`` required).

        Raises:
            SpecError: not a dict, a missing or unknown key, or a bad value.
        """
        if not isinstance(d, Mapping):
            raise SpecError(f"expected an object, got {_show(d)}")
        _check_keys(d, _PARAM_FIELDS, ("name", "shape", "dtype"), ())
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The JSON entry of the param, every field explicit (what :meth:`from_dict` reads)."""
        return {f: (list(self.shape) if f == "shape" else getattr(self, f)) for f in _PARAM_FIELDS}


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(ParamSpec))


@dataclasses.dataclass(frozen=True)
class Spec:
    """A full fusion scenario: parameters plus communication settings.

    Raises:
        SpecError: a field with a value it cannot take (checked however the spec is made:
            from a file, a dict, or ``dataclasses.replace``).
    """

    #: the model's params (:class:`ParamSpec`), in the order the model lists them
    params: tuple[ParamSpec, ...]
    #: the collective, one of :data:`ACTS`
    act: str = "all_reduce"
    #: the number of ranks, or None to give it when planning or checking
    nranks: int | None = None
    #: ``fused_parameters``' ``group_size``, bytes per buffer before it closes
    group_size: int = DEFAULT_GROUP_SIZE
    #: fp32 main grads for half-precision params
    use_main_grad: bool = False
    #: micro-steps per step
    acc_steps: int = 1
    #: the root of ``"reduce"`` (a rank below ``nranks``); -1 otherwise
    dst: int = -1
    #: whether the result is the mean over ranks (else the sum)
    average: bool = False

    def __post_init__(self) -> None:
        params = self.params
        if not isinstance(params, (list, tuple)):
            raise SpecError(f"expected a list, got {_show(params)}", ("params",))
        if not params:
            raise SpecError("must contain at least one parameter", ("params",))
        seen: dict[str, int] = {}
        for i, p in enumerate(params):
            if not isinstance(p, ParamSpec):
                raise SpecError(f"expected a ParamSpec, got {_show(p)}", ("params", i))
            if p.name in seen:
                raise SpecError(f"duplicate name {_show(p.name)} (first used by params[{seen[p.name]}])",
                                ("params", i, "name"))
            seen[p.name] = i
        object.__setattr__(self, "params", tuple(params))
        if self.act not in ACTS:
            raise SpecError(f"expected one of {', '.join(map(_show, ACTS))}, got {_show(self.act)}", ("act",))
        if self.nranks is not None:
            object.__setattr__(self, "nranks", _check_int(self.nranks, "nranks", 1))
        object.__setattr__(self, "group_size", _check_int(self.group_size, "group_size", 0))
        _check_bool(self.use_main_grad, "use_main_grad")
        object.__setattr__(self, "acc_steps", _check_int(self.acc_steps, "acc_steps", 1))
        _check_bool(self.average, "average")
        self._check_dst()

    def _check_dst(self) -> None:
        dst = self.dst
        if not _is_int(dst):
            raise SpecError(f"expected an int, got {_show(dst)}", ("dst",))
        object.__setattr__(self, "dst", int(dst))
        upper = f"nranks={self.nranks}" if self.nranks is not None else "nranks"
        if self.act == "reduce":
            if dst < 0 or (self.nranks is not None and dst >= self.nranks):
                raise SpecError(f"act \"reduce\" needs a destination rank in [0, {upper}), got {_show(dst)}",
                                ("dst",))
        elif dst != -1 and (dst < 0 or (self.nranks is not None and dst >= self.nranks)):
            raise SpecError(f"expected -1 or a rank in [0, {upper}), got {_show(dst)}", ("dst",))

    @property
    def numel(self) -> int:
        """Elements of all params together (unpadded)."""
        return sum(p.numel for p in self.params)

    @classmethod
    def from_dict(cls, d: Any, source: str = "<spec>") -> Spec:
        """Build from parsed JSON; every error is prefixed with ``source`` and the field path.

        Args:
            d: the spec's dict (the JSON layout: ``params`` required).
            source: the name errors give the spec (a file name).

        Raises:
            SpecError: the first problem found.
        """
        try:
            if not isinstance(d, Mapping):
                raise SpecError(f"expected a JSON object at the top level, got {_show(d)}")
            _check_keys(d, _SPEC_FIELDS, ("params",), ())
            raw = d["params"]
            if not isinstance(raw, list):
                raise SpecError(f"expected a list of parameter objects, got {_show(raw)}", ("params",))
            params = []
            for i, item in enumerate(raw):
                try:
                    params.append(ParamSpec.from_dict(item))
                except SpecError as e:
                    raise e.within("params", i) from None
            return cls(**{**d, "params": tuple(params)})
        except SpecError as e:
            raise e.within(source=source) from None

    @classmethod
    def from_preset(cls, name: str, *, dtype: str | None = None, **overrides: Any) -> Spec:
        """Spec for a built-in preset; half-precision presets default to fp32 main grads.

        Args:
            name: a preset (``mpifusion presets`` lists them).
            dtype: the params' dtype instead of the preset's.
            overrides: other fields of the spec (``act``, ``nranks`` ...).

        Raises:
            PresetError: an unknown preset or dtype.
            SpecError: an override with a value it cannot take.
        """
        from .presets import get_preset  # local: presets must stay importable on its own

        params = get_preset(name, dtype)
        defaults = {"use_main_grad": params[0]["dtype"] != "float32"}
        return cls.from_dict({"params": params, **defaults, **overrides}, source=f"preset {name}")

    def fused_params(self) -> list:
        """The params that are fused: Paddle fuses trainable params only (its ``trainable``
        is ``not stop_gradient``, so ``stop_gradient: true`` is not fused either)."""
        return [p for p in self.params if p.trainable and not p.stop_gradient]

    def plan(self, nranks: int | None = None) -> list:
        """Every buffer a job with this spec builds (``fused_parameters``'s order), planned
        without MPI; ``nranks`` defaults to the spec's.

        Args:
            nranks: the number of ranks to plan for (a reduce-scatter's shards need it).

        Returns:
            One planned buffer per buffer (its index, act, dtypes, params and layout),
            what ``mpifusion layout`` prints.

        Raises:
            PlanError: params that cannot be fused, or no ``nranks`` for a reduce-scatter.
        """
        from .plan.grouping import plan_model

        return plan_model(self.fused_params(), act=self.act, group_size=self.group_size,
                          use_main_grad=self.use_main_grad,
                          nranks=self.nranks if nranks is None else nranks,
                          is_decay=lambda p: p.decay)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with every field explicit, so a dumped spec reloads identically."""
        out: dict[str, Any] = {"params": [p.to_dict() for p in self.params]}
        out.update({f: getattr(self, f) for f in _SPEC_FIELDS if f != "params"})
        return out


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(Spec))




def load_spec(path: str | os.PathLike[str]) -> Spec:
    """Read and validate a spec file; I/O and JSON errors become ``SpecError`` too, for one
    CLI error path.

    Args:
        path: the JSON file.

    Raises:
        SpecError: unreadable, not JSON, too large or too deep, or an invalid spec.
    """
    source = os.fspath(path)
    try:  # a regular file only (a FIFO or a device would block or never end), bounded in size
        text = read_text(source)
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read: {getattr(e, 'strerror', None) or e}", source=source) from None
    except InputLimitError as e:
        raise SpecError(str(e), source=source) from None
    try:  # bounded in nesting depth and integer digits
        data = loads_strict_json(text, SpecError)
    except SpecError as e:
        raise e.within(source=source) from None
    except InputLimitError as e:
        raise SpecError(str(e), source=source) from None
    except json.JSONDecodeError as e:
        raise SpecError(f"not valid JSON: {e}", source=source) from None
    except RecursionError:
        raise SpecError("not valid JSON: nested too deeply", source=source) from None
    return Spec.from_dict(data, source=source)


def as_spec(spec: Any) -> Spec:
    """A :class:`~mpifusion.spec.Spec` from a Spec, a dict (the JSON layout) or a JSON path:
    the one rule every entry point that takes "a spec" follows.

    Args:
        spec: a Spec, a dict, or the path of a JSON spec file.

    Raises:
        SpecError: anything else, or an invalid spec.
    """
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, Mapping):
        return Spec.from_dict(dict(spec), source="<spec dict>")
    if isinstance(spec, (str, os.PathLike)):
        return load_spec(spec)
    raise SpecError(f"expected a Spec, a dict or the path of a JSON spec, got "
                    f"{type(spec).__name__}")
