"""What a refused call must leave as it was, for every test of a buffer's refusals: the
grad storage (the same object, the same bits), the param storage, the check-in counters,
the task, the step and status, each param's grad (the same object, the same bits) and the
fused views. One definition, so every refusal test holds the same standard."""
from __future__ import annotations

import numpy as np


def _bits(arr):
    return None if arr is None else np.asarray(arr).tobytes()  # tobytes copies


def snapshot(buf, ps) -> dict:
    return dict(
        storage=buf.grad_storage, is_shard=buf._grads_are_shard,
        values=_bits(buf.grad_storage), params=_bits(buf.param_storage),
        steps=dict(buf._checkin.steps), count=buf.checked_in, task=buf.task,
        step=buf._step, status=buf.status,
        grads=[(p.grad, _bits(p.grad)) for p in ps],
        views=dict(buf._grad_view))


def assert_unchanged(before: dict, buf, ps) -> None:
    after = snapshot(buf, ps)
    assert after["storage"] is before["storage"] and after["is_shard"] == before["is_shard"]
    for key in ("values", "params", "steps", "count", "task", "step", "status"):
        assert after[key] == before[key], key  # bytes: NaN-aware, bit for bit
    for (g0, v0), (g1, v1) in zip(before["grads"], after["grads"]):
        assert g1 is g0 and v1 == v0
    assert all(after["views"][k] is v for k, v in before["views"].items())
