"""``check_dump``: another implementation's dump against the float64 reference."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..dtypes import dtype_name
from ..plan.grouping import grad_dtype_for
from .bound import ErrorStats, bound_model, error_bound, summed
from .dumps import DumpError, _array, _open_npz, _rank_files


@dataclass
class CheckReport:
    """Result of :func:`check_dump`: per-param stats in spec order and the bound used."""

    stats: list
    bounds: dict  # grad dtype -> formula

    @property
    def failing(self) -> list:
        return [s.name for s in self.stats if not s.ok]

    @property
    def ok(self) -> bool:
        return not self.failing

    def to_json(self, spec: Any) -> dict:
        def num(x: float) -> Optional[float]:
            return None if math.isinf(x) or math.isnan(x) else x

        return {
            "verdict": "PASS" if self.ok else "FAIL",
            "act": spec.act, "nranks": spec.nranks, "acc_steps": spec.acc_steps,
            "average": spec.average, "dst": spec.dst, "bound": self.bounds,
            "params": [{"name": s.name, "compared": s.compared, "max_abs_err": num(s.max_abs),
                        "max_rel_err": num(s.max_rel), "err_over_bound": num(s.max_ratio),
                        "worst_rank": s.worst_rank, "nonfinite": s.nonfinite,
                        "nonfinite_reference": s.nonfinite_ref,
                        "nonfinite_mismatch": s.mismatched, "overflow": s.overflow,
                        "beyond_bound": s.beyond, "ok": s.ok, "reason": s.reason}
                       for s in self.stats],
        }


def check_dump(spec: Any, directory: str) -> CheckReport:
    """Check another implementation's dump (README, "Checking another implementation")
    against the float64 reference recomputed from its own inputs."""
    nranks = spec.nranks
    if nranks is None:
        raise DumpError("nranks: required by check (the number of rank files to read)")
    act, acc = spec.act, spec.acc_steps
    params = spec.fused_params()
    slots = {}
    if act == "reduce_scatter":
        for buf in spec.plan(nranks):
            for p in buf.params:
                slots[p.name] = buf.layout
    paths = _rank_files(directory, nranks)
    files = [_open_npz(path) for path in paths]
    report = CheckReport([], {})
    try:
        for p in params:
            grad_dtype = dtype_name(grad_dtype_for(p.dtype, spec.use_main_grad))
            report.bounds.setdefault(grad_dtype, bound_model(
                grad_dtype=grad_dtype, nranks=nranks, acc_steps=acc,
                average=spec.average).formula)
            terms = []
            for path, f in zip(paths, files):
                for k in range(acc):
                    x = _array(f, path, f"in/{p.name}/{k}", p.shape, p.dtype,
                               missing_ok=p.stop_gradient)
                    terms.append(np.zeros(p.shape) if x is None else x)
            ref, absolute = summed(terms)
            del terms
            if spec.average:
                ref /= nranks
            bound = error_bound(absolute, grad_dtype=grad_dtype, nranks=nranks, acc_steps=acc,
                                average=spec.average)
            stats = ErrorStats(p.name)
            for rank, (path, f) in enumerate(zip(paths, files)):
                key = f"out/{p.name}"
                if act == "all_reduce" or (act == "reduce" and rank == spec.dst):
                    out = _array(f, path, key, p.shape, p.dtype)
                    stats.update(out.reshape(-1), ref.reshape(-1), bound.reshape(-1), rank)
                elif act == "reduce_scatter":
                    lay = slots[p.name]
                    piece = lay.slice_of(p.name, rank)
                    begin, end = piece if piece else (0, 0)
                    out = _array(f, path, key, (end - begin,), p.dtype, missing_ok=not piece)
                    if out is None or not piece:
                        continue
                    slot = lay[p.name]
                    pad = slot.padded_numel - slot.numel
                    lo, hi = begin - slot.offset, end - slot.offset
                    ref_p = np.concatenate([ref.reshape(-1), np.zeros(pad)])[lo:hi]
                    bound_p = np.concatenate([bound.reshape(-1), np.zeros(pad)])[lo:hi]
                    stats.update(out, ref_p, bound_p, rank)
            report.stats.append(stats)
    finally:
        for f in files:
            f.close()
    return report
