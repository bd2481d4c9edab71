"""The speed and memory targets of ``mpifusion bench``: each a ratio within one run.

The targets inform, they do not set the exit code. Those set for bandwidth-bound syncs
(grads of at least :data:`BANDWIDTH_BOUND_BYTES`) are marked as not applying to smaller
models, whose steps are latency-bound.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ..timing import best_per_round, round_ratio
from .cluster import cluster_checks
from .workload import MiB

#: grads at least this large make a sync bandwidth-bound: the speed targets are set for them
BANDWIDTH_BOUND_BYTES = 64 * MiB


def met(value: float, target: str) -> bool:
    """Whether ``value`` meets ``target`` (``"<= 1.15"`` or ``">= 3"``)."""
    op, num = target.split()
    return value <= float(num) if op == "<=" else value >= float(num)


@dataclass
class Target:
    what: str
    value: float
    target: str
    applies: bool = True  # False: set for another regime (e.g. bandwidth-bound syncs)

    @property
    def met(self) -> bool:
        return met(self.value, self.target)


def targets(res: dict) -> List[Target]:
    """The targets of the sections this run measured (``--only`` runs one): the steps'
    and the cluster section's."""
    out = step_targets(res) if "steps" in res else []
    if res.get("cluster"):
        out.extend(Target(*check) for check in cluster_checks(res["cluster"]))
    return out


def step_targets(res: dict) -> List[Target]:
    """The speed and memory targets, each marked whether it applies to this model: the
    ratios against raw MPI, gloo and the overlap are set for bandwidth-bound syncs."""
    steps, raw = res["steps"], res["raw"]
    auto = res["meta"]["default_strategy"]
    default = f"ALL_REDUCE [{auto}]"
    step = steps[default] if default in steps \
        else next(v for k, v in steps.items() if k.startswith("ALL_REDUCE ["))
    big = res["meta"]["grad_bytes"] >= BANDWIDTH_BOUND_BYTES
    out = [
        Target("ALL_REDUCE step / best raw collective", round_ratio(step, res["floor"]),
               "<= 1.15", big),
        Target("ALL_REDUCE step / (best raw collective + 1/n scaling)",
               round_ratio(step, res["floor_with_scale"]), "<= 1.10", big),
        Target("naive flat Iallreduce / ALL_REDUCE step",
               round_ratio(raw["Iallreduce (naive, one call)"], step), ">= 3", big),
    ]
    for label, prefix in (("REDUCE", "REDUCE raw"),
                          ("REDUCE_SCATTER + sync_params", "REDUCE_SCATTER raw")):
        mine = steps.get(f"{label} [{auto}]")
        floors = [raw[k] for k in raw if k.startswith(prefix)]
        if mine and floors:  # per round: the best raw way of that round, with the same 1/n
            out.append(Target(f"{label} step / best raw {label.split()[0]} + the same 1/n",
                              round_ratio(mine, best_per_round(floors)), "<= 1.15", big))
    gloo_key = next((k for k in raw if "gloo" in k), None)
    if gloo_key:
        out.append(Target("torch gloo all_reduce / ALL_REDUCE step",
                          round_ratio(raw[gloo_key], step), ">= 4", big))
    ov = res["overlap"].get(f"{auto}/device")
    if ov:
        out.append(Target("overlap with emulated (device) compute, %", ov["overlap_pct"],
                          ">= 80", big))
    out.extend(shm_targets(res, big))
    out.append(Target("add_grad per param, us", res["add_grad"]["per_param_s"] * 1e6, "<= 3"))
    if res.get("order_check"):
        out.append(Target("order check cost, % of the ALL_REDUCE step (buffers x check)",
                          res["order_check"]["pct_of_step"], "<= 2", big))
    out.append(Target("peak memory / (params + grads + padding), ALL_REDUCE",
                      res["memory"]["ALL_REDUCE"]["ratio"], "<= 1.05", big))
    return out


def shm_targets(res: dict, big: bool) -> List[Target]:
    """The shm strategy's targets, where it ran (not fallen back to thread): the fp32 step
    against the best raw segmented Allreduce + 1/n and a memcpy of the grads (it should beat
    MPI's own collective on a node), the half-precision step against the fp32 one, small
    buffers against thread."""
    out: List[Target] = []
    shm = res["steps"].get("ALL_REDUCE [shm]")
    if shm is None or shm.get("fallback"):
        return out
    out.append(Target("shm ALL_REDUCE step / (best raw Allreduce + 1/n)",
                      round_ratio(shm, res["floor_with_scale"]), "<= 0.75", big))
    if "memcpy" in res:
        out.append(Target("shm ALL_REDUCE step / memcpy of the grads",
                          round_ratio(shm, res["memcpy"]), "<= 1.25", big))
    half = res.get("half_step")
    if half and half["strategy"] == "shm" and not half.get("fallback"):
        out.append(Target(f"shm ALL_REDUCE step, {half['dtype']} / float32",
                          round_ratio(half, shm), "<= 0.75", big))
    worst = [r["shm"]["x_thread"] for r in res.get("small_buffers", [])
             if "shm" in r and r["shm"].get("x_thread") is not None]
    if worst:
        out.append(Target("shm / thread, one 4-64 KiB buffer (the slowest size)", max(worst),
                          "<= 1.0"))
    return out
