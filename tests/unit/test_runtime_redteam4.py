"""Red-team round 4 of the runtime's input handling, in one process (COMM_SELF).

Each test is a finding: an input that was taken and answered wrongly (a grad dropped, a
transposed sum, NaN from under a mask), raised a raw Python error, or changed the buffer
before raising. Each must now be a ``FusionError`` (or, for ``Param``, a ``TypeError``)
naming the rank, buffer, param and what was expected, with nothing changed.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import FusedCommBuffer, Param, to_torch
from mpifusion.errors import GradError, NanInfError, OptionError

from tests.refusal import assert_unchanged, snapshot

SELF = MPI.COMM_SELF


def make(acc_steps=2, **kw):
    ps = [Param("w0", np.zeros(4, np.float32)), Param("w1", np.zeros((2, 2), np.float32))]
    return FusedCommBuffer(0, ps, SELF, act="all_reduce", acc_steps=acc_steps, **kw), ps


# --------------------------------------------------------------------------- use_comm
# add_grad(param, use_comm=True, grad=None) keeps Paddle's second positional argument, so
# add_grad(p, g) made g use_comm: a one-element grad was dropped while the param checked in
# (and a zero one, falsy, left communication unstarted on that rank only: the others hung);
# a longer one raised numpy's "truth value of an array is ambiguous"; "False" started comm.
def _positional_grads():
    yield "array of one", np.ones(1, np.float32)
    yield "array of zero", np.zeros(1, np.float32)
    yield "array", np.ones(4, np.float32)
    yield "string", "False"
    yield "int", 0


@pytest.mark.parametrize("what, value", list(_positional_grads()),
                         ids=[w for w, _ in _positional_grads()])
def test_use_comm_takes_a_bool_only(what, value):
    buf, ps = make()
    buf.add_grad(ps[1], grad=np.ones((2, 2), np.float32))
    before = snapshot(buf, ps)
    with pytest.raises(OptionError, match=r"^rank 0: buffer 0: param 'w0': add_grad: use_comm: "
                                          r"expected True or False, got .*grad=g"):
        buf.add_grad(ps[0], value)
    assert_unchanged(before, buf, ps)
    with pytest.raises(OptionError, match=r"^rank 0: buffer 0: mark_unused: use_comm: "
                                          r"expected True or False"):
        buf.mark_unused(ps[0], use_comm=value)
    assert_unchanged(before, buf, ps)


def test_use_comm_torch_scalar_is_refused():
    torch = pytest.importorskip("torch")
    buf, ps = make(acc_steps=1)
    before = snapshot(buf, ps)
    with pytest.raises(OptionError, match=r"param 'w0': add_grad: use_comm"):
        buf.add_grad(ps[0], torch.tensor(0.0))
    assert_unchanged(before, buf, ps)


def test_add_grad_of_something_not_a_param_names_it():
    buf, ps = make()
    before = snapshot(buf, ps)
    with pytest.raises(GradError, match=r"^rank 0: buffer 0: param 'None': not a param of "
                                        r"this buffer"):
        buf.add_grad("w0", grad=np.ones(4, np.float32))  # was AttributeError: no .name
    assert_unchanged(before, buf, ps)


# --------------------------------------------------------------------------- grad values
def test_masked_array_grad_is_refused():
    """A masked grad was added with the values under its mask (NaN here)."""
    buf, ps = make()
    before = snapshot(buf, ps)
    g = np.ma.array(np.array([1, 2, np.nan, 4], np.float32), mask=[0, 0, 1, 0])
    with pytest.raises(GradError, match=r"^rank 0: buffer 0: param 'w0': grad: a numpy masked "
                                        r"array .*expected a plain array"):
        buf.add_grad(ps[0], grad=g)
    assert_unchanged(before, buf, ps)
    with pytest.raises(TypeError, match=r"^Param 'm': array: a numpy masked array"):
        Param("m", np.ma.array(np.zeros(3, np.float32), mask=[0, 1, 0]))


class _Raises:
    """A DLPack producer whose export fails with an arbitrary exception."""

    def __init__(self, exc, device=(1, 0)):
        self.exc, self.device = exc, device

    def __dlpack_device__(self):
        if isinstance(self.device, Exception):
            raise self.device
        return self.device

    def __dlpack__(self, **kwargs):
        if self.exc is None:
            return 42  # not a capsule
        raise self.exc


@pytest.mark.parametrize("grad", [
    [[1.0], [1.0, 2.0], [3.0], [4.0]],          # ragged: numpy's ValueError
    _Raises(ValueError("export failed")),
    _Raises(KeyError("export failed")),
    _Raises(None),                              # __dlpack__ returns no capsule
    _Raises(ValueError("x"), device=ValueError("no device")),
], ids=["ragged list", "ValueError", "KeyError", "not a capsule", "device raises"])
def test_a_failing_grad_import_is_a_grad_error(grad):
    buf, ps = make()
    before = snapshot(buf, ps)
    with pytest.raises(GradError, match=r"^rank 0: buffer 0: param 'w0': grad: "):
        buf.add_grad(ps[0], grad=grad)
    assert_unchanged(before, buf, ps)


# --------------------------------------------------------------------------- rebound grads
# The moved-grad check compared addresses only: a grad rebound to another array at the same
# address passed it and was accumulated into -- transposed (a wrong sum, silently), or a raw
# numpy/AttributeError for a reshaped, sliced, reinterpreted or torch one.
def test_a_transposed_grad_at_the_same_address_is_refused():
    buf, ps = make(acc_steps=1)
    ps[1].grad = ps[1].grad.T
    before = snapshot(buf, ps)
    with pytest.raises(GradError, match=r"^rank 0: buffer 0: param 'w1': its grad is at the "
                                        r"address of its view but is not the view .*strides"):
        buf.add_grad(ps[1], grad=np.array([[1, 2], [3, 4]], np.float32))
    assert_unchanged(before, buf, ps)


@pytest.mark.parametrize("rebind, what", [
    (lambda g: g.reshape(-1), "shape"),
    (lambda g: g[0], "shape"),
    (lambda g: g.view(np.int32), "dtype"),
], ids=["reshaped", "sliced", "int view"])
def test_a_grad_rebound_at_the_same_address_is_refused(rebind, what):
    buf, ps = make()
    ps[1].grad = rebind(ps[1].grad)
    before = snapshot(buf, ps)
    with pytest.raises(GradError, match=rf"param 'w1': its grad is at the address of its view "
                                        rf"but is not the view .*{what}"):
        buf.add_grad(ps[1], grad=np.ones((2, 2), np.float32))
    assert_unchanged(before, buf, ps)


def test_an_equal_view_or_torch_view_of_the_slot_is_still_the_view():
    pytest.importorskip("torch")
    buf, ps = make(acc_steps=2)
    ps[1].grad = ps[1].grad[...]           # another object, the same view
    buf.add_grad(ps[1], grad=np.ones((2, 2), np.float32))
    ps[1].grad = to_torch(ps[1].grad)      # a torch tensor over the same memory
    buf.add_grad(ps[1], grad=np.full((2, 2), 2.0, np.float32))  # was AttributeError
    ps[0].grad = to_torch(ps[0].grad)
    buf.add_grad(ps[0], grad=np.ones(4, np.float32))
    buf.add_grad(ps[0])
    buf.scale_grads()
    np.testing.assert_array_equal(buf.grad_storage[buf.layout["w1"].offset:][:4], np.full(4, 3.0))
    np.testing.assert_array_equal(buf.grad_storage[:4], np.ones(4))


def test_clear_grad_storage_drops_a_torch_view_of_the_slot():
    torch = pytest.importorskip("torch")
    buf, ps = make(acc_steps=1, release_grads=True)
    buf.add_grad(ps[0], grad=np.ones(4, np.float32))
    buf.add_grad(ps[1], grad=np.ones((2, 2), np.float32))
    buf.scale_grads()
    ps[0].grad = to_torch(ps[0].grad)
    other = torch.ones(2, 2)
    ps[1].grad = other                         # not the buffer's: kept
    buf.clear_grad_storage()                   # was AttributeError
    assert buf.grad_storage is None and ps[0].grad is None and ps[1].grad is other


# --------------------------------------------------------------------------- release_grads
# The param's own grad (moved into the buffer at its first micro-step) was used as it was
# set: a torch tensor or a list raised AttributeError after the grad buffer was allocated,
# and a negated torch view would have been read without its sign.
def _own_grads():
    torch = pytest.importorskip("torch")
    yield "torch", torch.full((4,), 2.0), 2.0
    yield "negated torch view", torch._neg_view(torch.full((4,), 2.0)), -2.0


@pytest.mark.parametrize("how", ["add_grad", "mark_unused"])
def test_release_grads_moves_a_torch_own_grad(how):
    for what, own, value in _own_grads():
        buf, ps = make(acc_steps=1, release_grads=True)
        ps[0].grad = own
        if how == "add_grad":
            buf.add_grad(ps[0], grad=np.ones(4, np.float32))
            value += 1.0
        else:  # checked in with zero gradient: the moved grad is zeroed (README)
            buf.mark_unused(ps[0])
            value = 0.0
        np.testing.assert_array_equal(buf.grad_storage[:4], np.full(4, value), err_msg=what)
        np.testing.assert_array_equal(ps[0].grad, np.full(4, value), err_msg=what)


def test_naninf_error_counts_a_grad_that_is_a_torch_view_of_its_slot():
    pytest.importorskip("torch")
    buf, ps = make(acc_steps=1, check_naninf=True)
    ps[0].grad = to_torch(ps[0].grad)
    buf.add_grad(ps[1], grad=np.ones((2, 2), np.float32))
    before = snapshot(buf, ps)
    with pytest.raises(NanInfError, match=r"w0 \(2 of 4\)"):  # was a raw TypeError
        buf.add_grad(ps[0], grad=np.array([1, np.nan, np.inf, 1], np.float32))
    assert_unchanged(before, buf, ps)


def test_assign_slice_grad_of_something_not_a_param_of_the_buffer_is_refused():
    """A str raised AttributeError; another Param of the same name was taken for the
    buffer's (the membership test was by name only; add_grad's is by object)."""
    p = Param("w", np.zeros(4, np.float32))
    buf = FusedCommBuffer(0, [p], SELF, act="reduce_scatter")
    for foreign in ("w", Param("w", np.zeros(4, np.float32))):
        s = Param("s", np.zeros(64, np.float32))
        with pytest.raises(GradError, match=r"^rank 0: buffer 0: param '(None|w)': not a param "
                                            r"of this buffer"):
            buf.assign_slice_grad(foreign, s)
        assert s.grad is None and s.data.shape == (64,)
    buf.assign_slice_grad(p, s)
    assert s.data.shape == (64,) and np.shares_memory(s.grad, buf.grad_storage)


# --------------------------------------------------------------------------- byte spans


def test_byte_span_is_numpys_byte_bounds_for_any_view():
    """The overlap rule's memory span of a view (negative, gapped, zero strides; empty):
    numpy's own byte_bounds is the independent reference. data_ptr + nbytes, as before,
    is wrong for every reversed or gapped view."""
    from numpy.lib.array_utils import byte_bounds

    from mpifusion.arrays import backend

    rng = np.random.default_rng(7)
    base = np.zeros((6, 7, 5), np.float32)
    wrong = 0
    for _ in range(500):
        view = base
        for axis in range(3):
            n = view.shape[axis]
            start, stop = sorted(rng.integers(0, n + 1, size=2))
            step = int(rng.choice([1, 2, 3, -1, -2]))
            index = [slice(None)] * view.ndim
            index[axis] = slice(start, stop, step) if step > 0 else slice(stop, start, step)
            view = view[tuple(index)]
        if rng.random() < 0.3:
            view = view.transpose(tuple(rng.permutation(3)))
        if view.size == 0:
            assert backend.byte_span(view)[0] == backend.byte_span(view)[1]
            continue
        assert backend.byte_span(view) == byte_bounds(view), (view.shape, view.strides)
        lo = backend.data_ptr(view)
        wrong += (lo, lo + view.nbytes) != byte_bounds(view)
    assert wrong > 100  # the sampling does reach views the old rule got wrong
    assert backend.byte_span(np.broadcast_to(np.float32(1), (4, 3)))[1] - \
        backend.byte_span(np.broadcast_to(np.float32(1), (4, 3)))[0] == 4


def test_reversed_grad_over_its_own_slot_is_named_as_such():
    """A grad whose first element lies in the alignment padding after the param's slot and
    which runs backwards over the slot: the old span (first element + nbytes) missed the
    slot and blamed another param; now named as its own view's overlap. Nothing changes."""
    buf, ps = make()
    buf.add_grad(ps[1], grad=np.ones((2, 2), np.float32))
    storage, view = buf.grad_storage, buf._grad_view["w0"]
    assert storage.size >= 8 and np.shares_memory(storage[:4], view)  # padding after w0
    backwards = np.lib.stride_tricks.as_strided(storage[5:], shape=(4,), strides=(-4,))
    assert np.shares_memory(backwards, view) and not backend_same(backwards, view)
    before = snapshot(buf, ps)
    with pytest.raises(GradError, match=r"param 'w0': grad overlaps part of its own grad view"):
        buf.add_grad(ps[0], grad=backwards)
    assert_unchanged(before, buf, ps)


def backend_same(a, b):
    from mpifusion.arrays import backend

    return backend.same_view(a, b)


# --------------------------------------------------------------------------- on/off arguments


@pytest.mark.parametrize("value", ["False", 0, 1, None, np.array([True, False])])
def test_sync_params_and_reset_switches_are_bools(value):
    """``sync_params(sync="False")`` ran blocking and ``reset(abandon="False")`` would have
    abandoned a collective in flight: truthiness decided. Each is now an OptionError naming
    rank, buffer and argument, before anything changes."""
    ps = [Param("w0", np.zeros(5, np.float32)), Param("w1", np.zeros(3, np.float32))]
    buf = FusedCommBuffer(0, ps, SELF, act="reduce_scatter", acc_steps=1)
    for p in ps:
        buf.add_grad(p, grad=np.ones(p.shape, np.float32))
    buf.scale_grads()
    before = snapshot(buf, ps)
    with pytest.raises(OptionError, match=r"rank 0: buffer 0: sync_params: sync: expected "
                                          r"True or False"):
        buf.sync_params(sync=value)
    for arg in ("abandon", "zero_grads"):
        with pytest.raises(OptionError, match=rf"rank 0: buffer 0: reset: {arg}: expected "
                                              rf"True or False"):
            buf.reset(**{arg: value})
    assert_unchanged(before, buf, ps)
    buf.reset(abandon=np.bool_(False), zero_grads=False)
    assert buf.sync_params(sync=np.bool_(True)) is None
