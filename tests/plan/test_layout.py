"""The layout planner against Paddle's golden vectors and against its own invariants."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpifusion.plan.layout import (ALIGNMENT_BYTES, TensorMeta, eager_assign_group_by_size,
                              get_group_size, group_indices_by_size, plan_flat, plan_sharded)

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def metas(*shapes_dtypes):
    return [TensorMeta(f"t{i}", shape, dtype) for i, (shape, dtype) in enumerate(shapes_dtypes)]


ALT = metas(*[([1, 50], "float32") if i % 2 == 0 else ([1, 25], "float64") for i in range(6)])
X4 = metas(*[([2, 50], "float32")] * 4)

# SEMANTICS.md section 1: outputs of Paddle 3.3.1's core.eager_assign_group_by_size
GOLDEN = [
    (metas(([2, 50], "float32"), ([2, 100], "float32"), ([2, 50], "float32"), ([2, 25], "float32")),
     None, [400], None, [[0], [1], [2], [3]]),
    (ALT, None, [400], None, [[0, 2], [1, 3], [4], [5]]),
    (ALT, None, [200, 400], None, [[0], [1], [2, 4], [3, 5]]),
    (ALT, None, [0], None, [[0], [1], [2], [3], [4], [5]]),
    (ALT, None, [10000], None, [[0, 2, 4], [1, 3, 5]]),
    (ALT, [True, False, False, False, False, True], [400], None, [[0], [1, 3], [2, 4], [5]]),
    (X4, None, [400, 800], None, [[0], [1, 2], [3]]),
    (X4, None, [400, 800], [3, 0, 1, 2], [[3], [0, 1], [2]]),
    (X4, [False, False, False, True], [300], [1, 0, 2, 3], [[1], [0], [2], [3]]),
]


@pytest.mark.parametrize("tensors, sparse, limits, indices, expected", GOLDEN)
def test_paddle_golden_vectors(tensors, sparse, limits, indices, expected):
    sparse = sparse or [False] * len(tensors)
    assert eager_assign_group_by_size(tensors, sparse, limits, indices) == expected


def test_leftover_groups_follow_paddle_dtype_order_when_indices_given():
    # fp16 before fp32 in the input, but Paddle's enum puts float32 (10) before float16 (15)
    ts = metas(([4], "float16"), ([4], "float32"))
    assert eager_assign_group_by_size(ts, [False, False], [10 ** 6], [0, 1]) == [[1], [0]]
    assert eager_assign_group_by_size(ts, [False, False], [10 ** 6]) == [[0], [1]]


def test_bad_grouping_input_is_named():
    with pytest.raises(ValueError, match="tensor_indices"):
        eager_assign_group_by_size(X4, [False] * 4, [400], [0, 0, 1, 2])
    with pytest.raises(ValueError, match="is_sparse_gradient"):
        eager_assign_group_by_size(X4, [False] * 3, [400])
    with pytest.raises(ValueError, match="group_size"):
        group_indices_by_size(X4, -1)


def test_flat_offsets_are_256_byte_aligned_in_param_dtype():
    layout = plan_flat(metas(([10, 3], "float32"), ([64], "float32"), ([1], "float32")))
    assert [(s.offset, s.numel, s.padded_numel) for s in layout.slots] == [
        (0, 30, 64), (64, 64, 64), (128, 1, 64)]
    assert layout.numel == 192
    half = plan_flat(metas(([10, 3], "bfloat16"), ([129], "bfloat16")))
    assert [(s.offset, s.padded_numel) for s in half.slots] == [(0, 128), (128, 256)]


def test_reduce_scatter_layout_matches_the_documented_example():
    # the documented JSON example: w0 [10, 3] fp32 at 4 ranks -> padded 256, slice [0, 256)
    layout = plan_sharded(metas(([10, 3], "float32"), ([1000], "float32")), nranks=4)
    w0 = layout["t0"]
    assert (w0.offset, w0.padded_numel) == (0, 256)
    assert layout.slices("t0") == [(0, 256), None, None, None]
    assert layout.numel == 256 + 1024 and layout.shard_numel == 320
    # t1 spans ranks 0..3: [256, 320) [320, 640) [640, 960) [960, 1280)
    assert layout.slices("t1") == [(256, 320), (320, 640), (640, 960), (960, 1280)]


def test_get_group_size_is_paddles_optimizer_state_estimate():
    ts = metas(([1024, 1024], "float32"), ([1024, 1024], "bfloat16"))
    sizes = get_group_size(ts, group_size=1 << 30)
    assert sizes == pytest.approx([4 / 1024 * 12 / 4, 2 / 1024 * 12 / 2])


def test_mixed_dtypes_and_duplicate_names_rejected():
    with pytest.raises(ValueError, match="t1.*float16"):
        plan_flat(metas(([4], "float32"), ([4], "float16")))
    with pytest.raises(ValueError, match="unique"):
        plan_flat([TensorMeta("a", [2], "float32"), TensorMeta("a", [3], "float32")])
    with pytest.raises(ValueError, match="nranks"):
        plan_sharded(metas(([4], "float32")), 0)


# ---------------------------------------------------------------- properties

shapes = st.lists(st.integers(1, 300), min_size=1, max_size=3)
dtypes = st.sampled_from(sorted(ITEMSIZE))


@st.composite
def tensor_lists(draw):
    dtype = draw(dtypes)
    n = draw(st.integers(1, 12))
    return [TensorMeta(f"p{i}", draw(shapes), dtype) for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(tensor_lists())
def test_flat_layout_invariants(tensors):
    layout = plan_flat(tensors)
    size = ITEMSIZE[tensors[0].dtype]
    end = 0
    for t, slot in zip(tensors, layout.slots):
        assert slot.offset == end                       # in order, no gaps, no overlap
        assert (slot.offset * size) % ALIGNMENT_BYTES == 0
        assert slot.numel == math.prod(t.shape)
        assert slot.numel <= slot.padded_numel < slot.numel + ALIGNMENT_BYTES // size
        end = slot.padded_end
    assert layout.numel == end


@settings(max_examples=150, deadline=None)
@given(tensor_lists(), st.integers(1, 9))
def test_sharded_layout_partitions_every_element(tensors, nranks):
    layout = plan_sharded(tensors, nranks)
    size = ITEMSIZE[tensors[0].dtype]
    assert layout.numel % nranks == 0
    shards = [layout.shard_range(r) for r in range(nranks)]
    assert shards[0][0] == 0 and shards[-1][1] == layout.numel
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
    for slot in layout.slots:
        assert slot.padded_numel % ((ALIGNMENT_BYTES // size) * nranks) == 0
        assert (slot.offset * size) % ALIGNMENT_BYTES == 0
        pieces = [p for p in layout.slices(slot.name) if p is not None]
        # the pieces tile the padded slot exactly once, in rank order
        assert pieces[0][0] == slot.offset and pieces[-1][1] == slot.padded_end
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        for r, piece in enumerate(layout.slices(slot.name)):
            if piece is not None:
                lo, hi = shards[r]
                assert lo <= piece[0] < piece[1] <= hi


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(shapes, dtypes), min_size=1, max_size=15),
       st.integers(0, 5000), st.booleans())
def test_grouping_invariants(items, limit, permute):
    tensors = [TensorMeta(f"p{i}", s, d) for i, (s, d) in enumerate(items)]
    # with indices, tensors come in the permuted order and indices give their real positions
    indices = list(reversed(range(len(tensors)))) if permute else None
    given_order = [tensors[i] for i in indices] if permute else tensors
    groups = eager_assign_group_by_size(given_order, [False] * len(tensors), [limit, limit],
                                        indices)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(tensors)))          # every tensor exactly once
    for g in groups:
        assert len({tensors[i].dtype for i in g}) == 1   # dtypes never mix
        nbytes = [tensors[i].nbytes for i in g]
        assert sum(nbytes[:-1]) < limit or len(g) == 1   # closes right after reaching limit
    if not permute:
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)
