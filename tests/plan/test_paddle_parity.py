"""Layouts against PaddlePaddle itself (CPU build): the grouping of ``core.eager_assign_group_by_size``
and the offsets / shard slices of tensor_fusion_helper, on random models.

Skipped where paddle is not installed (``pip install -e '.[paddle]'``; scripts/test.sh installs it).
"""
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpifusion.plan.layout import (TensorMeta, eager_assign_group_by_size, get_group_size, plan_flat,
                              plan_sharded)

paddle = pytest.importorskip("paddle")
from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh  # noqa: E402
from paddle.framework import core  # noqa: E402

# tensor_fusion_helper only plans for accelerators; its planning code runs on the CPU as is.
tfh.__current_device_type__ = "gpu"
DTYPES = ["float16", "bfloat16", "float32"]  # the dtypes Paddle's helper aligns
_names = itertools.count()


def paddle_params(metas):
    out = []
    for m in metas:
        p = paddle.create_parameter(list(m.shape), m.dtype, name=f"parity_{next(_names)}",
                                    default_initializer=paddle.nn.initializer.Constant(0.0))
        out.append(p)
    return out


shapes = st.lists(st.integers(1, 200), min_size=1, max_size=2)
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(st.tuples(shapes, st.sampled_from(DTYPES + ["float64"]), st.booleans()),
                min_size=1, max_size=10),
       st.lists(st.integers(0, 4000), min_size=1, max_size=3), st.booleans())
def test_grouping_matches_paddle(items, limits, permute):
    metas = [TensorMeta(f"t{i}", s, d) for i, (s, d, _) in enumerate(items)]
    sparse = [sp for _, _, sp in items]
    indices = list(reversed(range(len(metas)))) if permute else []
    tensors = [paddle.zeros(m.shape, m.dtype) for m in metas]
    want = core.eager_assign_group_by_size(tensors, sparse, limits, indices)
    got = eager_assign_group_by_size(metas, sparse, limits, indices or None)
    assert got == [list(g) for g in want]


@st.composite
def models(draw):
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 8))
    return [TensorMeta(f"p{i}", draw(shapes), dtype) for i in range(n)]


@SETTINGS
@given(models())
def test_flatten_offsets_match_paddle(metas):
    params = paddle_params(metas)
    _, total, offsets = tfh.flatten_dense_tensors(params, release_grad=True)
    layout = plan_flat(metas)
    assert layout.numel == int(total)
    assert [s.offset for s in layout.slots] == [int(offsets[p.name]) for p in params]


@SETTINGS
@given(models(), st.integers(1, 8), st.data())
def test_reduce_scatter_layout_matches_paddle(metas, nranks, data):
    rank = data.draw(st.integers(0, nranks - 1))
    params = paddle_params(metas)
    views, total, *_ = tfh.build_reduce_scatter_buffer(params, nranks, rank)
    layout = plan_sharded(metas, nranks)
    assert layout.numel == int(total)
    for m, p in zip(metas, params):
        view, slot = views[p.name], layout[m.name]
        assert (slot.offset, slot.padded_numel) == (int(view._index), int(view._padded_size))
        ours = layout.slice_of(m.name, rank)
        if view.has_effective_slice_param:
            assert ours == (int(view._param_begin), int(view._param_end))
        else:
            assert ours is None


@SETTINGS
@given(models(), st.integers(0, 1 << 16))
def test_group_size_estimate_matches_paddle(metas, group_size):
    params = paddle_params(metas)
    want = tfh.get_group_size(params, group_size)
    assert get_group_size(metas, group_size) == pytest.approx([float(x) for x in want])
