"""What the buffer takes as input, and what it refuses before anything changes.

Inputs that used to be taken and gave a wrong or late answer:

* on/off options read by truthiness (``use_reduce_avg="False"`` turned averaging on);
* numpy integers refused as REDUCE's ``dst``;
* float64 params with main grads rounded to an fp32 grad buffer;
* int/bool/complex params accepted, then failing inside the collective (a KeyError text);
* ``MPI.COMM_NULL`` as ``comm_group`` failing inside MPI with no rank;
* grads taken and answered wrongly (a grad dropped, a transposed sum, NaN from under a mask),
  a raw Python error, or a buffer changed before raising: now a ``FusionError`` (or, for
  ``Param``, a ``TypeError``) naming the rank, buffer, param and what was expected;
* a grad passed positionally to ``add_grad(param, use_comm=True, grad=None)`` became
  ``use_comm``: falsy on rank 0, truthy elsewhere, the ranks parted ways.

The one-process cases run on COMM_SELF; the ``mpi`` ones at every rank count.
"""
import re

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import (FusedCommBuffer, LayoutError, OptionError, Param, fused_parameters,
                       obtain_storage, to_torch)
from mpifusion.dtypes import ITEMSIZES, bfloat16
from mpifusion.errors import GradError, NanInfError
from mpifusion.plan.grouping import PlanError, grad_dtype_name, plan_model, split_params
from mpifusion.plan.layout import FUSABLE_DTYPES, TensorMeta, check_fusable, plan_flat
from mpifusion.runtime.options import SWITCHES, check_comm_group, check_switch

from tests.refusal import assert_unchanged, snapshot


def _param(name="w", dtype=np.float32, **kw):
    return Param(name, np.zeros(4, dtype), **kw)


# ---------------------------------------------------------------------------------- on/off options
BAD_SWITCHES = ["False", "True", "0", "", 0, 1, 0.0, [], [False], np.array([True, False])]


@pytest.mark.parametrize("option", SWITCHES)
@pytest.mark.parametrize("value", BAD_SWITCHES, ids=repr)
def test_switch_refuses_anything_but_a_bool(option, value):
    p = _param()
    with pytest.raises(OptionError) as info:
        FusedCommBuffer(7, [p], MPI.COMM_SELF, act="all_reduce", **{option: value})
    msg = str(info.value)
    assert msg.startswith(f"rank 0: buffer 7: {option}: expected True or False"), msg
    assert repr(value) in msg, msg
    assert p.grad is None and p.main_grad is None  # nothing was built


@pytest.mark.parametrize("option", [o for o in SWITCHES if o != "use_main_grad"])
def test_switch_refuses_none_where_the_default_is_not_none(option):
    with pytest.raises(OptionError, match=rf"buffer 0: {option}: expected True or False, "
                                          rf"got None"):
        FusedCommBuffer(0, [_param()], MPI.COMM_SELF, act="all_reduce", **{option: None})


def test_strings_no_longer_turn_options_on():
    """Each of these was taken as True."""
    for option in ("use_reduce_avg", "scale_after_comm", "use_main_grad"):
        with pytest.raises(OptionError, match=rf"{option}: expected True or False.*'False'"):
            FusedCommBuffer(0, [_param()], MPI.COMM_SELF, act="all_reduce", **{option: "False"})


def test_numpy_bools_are_bools():
    p = _param()
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce",
                          use_main_grad=np.False_, scale_after_comm=np.False_,
                          use_reduce_avg=np.True_, release_grads=np.bool_(False))
    assert buf.use_main_grad is False and buf.options.scale_after_comm is False
    assert buf.options.use_reduce_avg is True and buf.options.release_grads is False
    assert all(type(getattr(buf.options, o)) is bool for o in SWITCHES if o != "use_main_grad")
    assert buf.options.use_main_grad is False


def test_use_main_grad_none_still_means_params0_has_a_main_grad():
    p = Param("w", np.zeros(4, np.float16), main_grad=np.zeros(4, np.float32))
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce", use_main_grad=None)
    assert buf.use_main_grad is True and p.main_grad.dtype == np.float32


def test_check_switch():
    assert check_switch(True, "x") is True and check_switch(np.False_, "x") is False
    assert check_switch(None, "x", allow_none=True) is None
    with pytest.raises(OptionError, match=r"^x: expected True or False or None, got 'no'$"):
        check_switch("no", "x", allow_none=True)


@pytest.mark.parametrize("kw", [dict(comm_overlap="False"), dict(group_params="False"),
                                dict(use_reduce_avg="False"), dict(scale_after_comm=1),
                                dict(use_main_grad="False"), dict(fuse_param="True")], ids=str)
def test_fused_parameters_switches_are_bools(kw):
    name = next(iter(kw))
    params = [_param("a"), _param("b")]
    with pytest.raises(OptionError, match=rf"^rank 0: {name}: expected True or False"):
        fused_parameters(params, comm_group=MPI.COMM_SELF, act="all_reduce", **kw)
    assert all(p.grad is None and not p._backward_hooks for p in params)


def test_obtain_storage_switches_are_bools():
    for kw in (dict(comm_overlap="no"), dict(clip="no"), dict(dist=None)):
        with pytest.raises(OptionError, match=rf"rank 0: {next(iter(kw))}: expected True"):
            obtain_storage([_param()], comm_group=MPI.COMM_SELF, act="all_reduce", **kw)


# --------------------------------------------------------------------------------------------- dst
@pytest.mark.parametrize("dst", [0, np.int64(0), np.int32(0), np.uint8(0)], ids=repr)
def test_reduce_dst_takes_numpy_integers(dst):
    p = _param()
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="reduce", dst=dst)
    assert buf.dst == 0 and type(buf.dst) is int and buf.dst_rank == 0
    buf.add_grad(p, grad=np.full(4, 2.0, np.float32))
    buf.scale_grads()
    np.testing.assert_array_equal(p.grad, np.full(4, 2.0, np.float32))


@pytest.mark.parametrize("dst", [True, np.True_, np.False_, 0.0, "0", np.float64(0)], ids=repr)
def test_reduce_dst_refuses_bools_and_non_integers(dst):
    with pytest.raises(LayoutError, match=rf"dst: REDUCE expected the root's global rank "
                                          rf"\(an int >= 0\), got {re.escape(repr(dst))}$"):
        FusedCommBuffer(0, [_param()], MPI.COMM_SELF, act="reduce", dst=dst)


def test_other_acts_take_a_numpy_minus_one():
    buf = FusedCommBuffer(0, [_param()], MPI.COMM_SELF, act="all_reduce", dst=np.int64(-1))
    assert buf.dst == -1 and type(buf.dst) is int


# ------------------------------------------------------------------------------ float64 main grads
def test_grad_dtype_rule_main_grads_never_narrower_than_the_param():
    assert grad_dtype_name("float64", True) == "float64"
    assert grad_dtype_name("float64", False) == "float64"
    assert grad_dtype_name("float32", True) == "float32"
    assert grad_dtype_name("bfloat16", True) == "float32"
    assert grad_dtype_name("float16", True) == "float32"
    assert grad_dtype_name("bfloat16", False) == "bfloat16"


@pytest.mark.parametrize("how", ["use_main_grad=True", "main_grad array"])
@pytest.mark.parametrize("act", ["all_reduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize("release_grads", [False, True])
def test_float64_main_grads_stay_float64(how, act, release_grads):
    kw = dict(main_grad=np.zeros(4, np.float64)) if how == "main_grad array" else {}
    p = Param("w", np.zeros(4, np.float64), **kw)
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act=act, dst=0 if act == "reduce" else -1,
                          use_main_grad=True if kw == {} else None,
                          release_grads=release_grads)
    assert buf.use_main_grad and buf.grad_dtype == np.float64
    g = np.full(4, 1 + 2.0 ** -40)  # not an fp32 number
    buf.add_grad(p, grad=g)
    buf.scale_grads()
    assert p.main_grad.dtype == np.float64
    np.testing.assert_array_equal(p.main_grad - 1, np.full(4, 2.0 ** -40))


def test_plan_model_float64_main_grads():
    metas = [TensorMeta("a", (3,), "float64"), TensorMeta("b", (5,), "float64")]
    (planned,) = plan_model(metas, act="all_reduce", group_size=1 << 20, use_main_grad=True,
                            nranks=None, is_decay=lambda p: False)
    assert planned.grad_dtype == "float64" and planned.grad_nbytes == planned.layout.numel * 8


# ------------------------------------------------------------------------------------ param dtypes
def test_fusable_dtypes_are_the_sized_ones():
    assert set(FUSABLE_DTYPES) == set(ITEMSIZES)


NON_FLOAT = [np.int32, np.int8, np.int64, np.uint8, np.complex64, np.bool_, np.float128
             if hasattr(np, "float128") else np.complex128]


@pytest.mark.parametrize("dtype", NON_FLOAT, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act,fuse_param", [("all_reduce", False), ("all_reduce", True),
                                            ("reduce", False), ("reduce", True),
                                            ("reduce_scatter", False)])
def test_buffer_refuses_non_float_params(dtype, act, fuse_param):
    name = np.dtype(dtype).name
    p = Param("layer.w", np.zeros(4, dtype))
    with pytest.raises(LayoutError) as info:
        FusedCommBuffer(0, [p], MPI.COMM_SELF, act=act, dst=0 if act == "reduce" else -1,
                        fuse_param=fuse_param)
    msg = str(info.value)
    assert msg.startswith("rank 0: param 'layer.w': dtype "), msg
    assert f"dtype {name} cannot be fused" in msg, msg
    assert "expected one of float64, float32, bfloat16, float16" in msg, msg
    assert p.grad is None and p.data.dtype == np.dtype(dtype)  # nothing changed


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, bfloat16],
                         ids=lambda d: np.dtype(d).name)
def test_float_params_are_still_fused(dtype):
    p = Param("w", np.zeros(4, dtype))
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce")
    buf.add_grad(p, grad=np.ones(4, dtype))
    buf.scale_grads()
    np.testing.assert_array_equal(p.grad.astype(np.float64), np.ones(4))


def test_planner_refuses_non_float_dtypes():
    with pytest.raises(ValueError, match=r"param 'b': dtype int32 cannot be fused"):
        plan_flat([TensorMeta("b", (3,), "int32")])
    with pytest.raises(ValueError, match=r"param 'c': dtype bool cannot be fused"):
        check_fusable([TensorMeta("a", (3,), "float32"), TensorMeta("c", (1,), "bool")])
    with pytest.raises(PlanError, match=r"param 'b': dtype int64 cannot be fused"):
        split_params([TensorMeta("a", (3,), "float32"), TensorMeta("b", (3,), "int64")],
                     lambda p: False)


def test_fused_parameters_refuses_before_building_any_buffer():
    """The fp32 split is built first: it must not be, when another split cannot be."""
    good, bad = _param("good"), Param("steps", np.zeros(4, np.int32))
    data = good.data
    with pytest.raises(LayoutError, match=r"^rank 0: param 'steps': dtype int32 cannot be "
                                          r"fused; expected one of float64, float32"):
        fused_parameters([good, bad], comm_group=MPI.COMM_SELF, act="all_reduce",
                         comm_overlap=True)
    assert good.data is data and good.grad is None and not good._backward_hooks


def test_obtain_storage_refuses_before_building_any_buffer():
    good, bad = _param("good"), Param("mask", np.zeros(4, np.bool_))
    with pytest.raises(LayoutError, match=r"param 'mask': dtype bool cannot be fused"):
        obtain_storage([good, bad], comm_group=MPI.COMM_SELF, act="all_reduce",
                       comm_overlap=True, group_size=1)
    assert good.grad is None and not good._backward_hooks


# -------------------------------------------------------------------------------------- comm_group
def test_comm_null_is_an_option_error():
    with pytest.raises(OptionError, match=r"^rank 0: comm_group: expected a valid "
                                          r"communicator, got MPI.COMM_NULL"):
        fused_parameters([_param()], comm_group=MPI.COMM_NULL, act="all_reduce")
    freed = MPI.COMM_SELF.Dup()
    freed.Free()
    with pytest.raises(OptionError, match=r"rank 0: comm_group: expected a valid"):
        obtain_storage([_param()], comm_group=freed, act="all_reduce")
    with pytest.raises(OptionError, match=r"^here: comm_group: expected an mpi4py "
                                          r"communicator or None, got str"):
        check_comm_group("world", "here")
    check_comm_group(None, "here")
    check_comm_group(MPI.COMM_SELF, "here")


def test_fused_comm_buffer_refuses_comm_null_naming_rank_and_buffer():
    from mpi4py import MPI

    from mpifusion import FusedCommBuffer, Param
    from mpifusion.errors import OptionError

    p = Param("w", np.zeros(4, np.float32))
    with pytest.raises(OptionError, match=r"rank \d+: buffer 7: comm_group: expected a valid "
                                          r"communicator, got MPI.COMM_NULL"):
        FusedCommBuffer(7, [p], MPI.COMM_NULL, act="all_reduce")
    freed = MPI.COMM_SELF.Dup()
    freed.Free()
    with pytest.raises(OptionError, match="MPI.COMM_NULL"):
        FusedCommBuffer(8, [p], freed, act="all_reduce")


@pytest.mark.parametrize("kw, what", [({"acc_steps": 2.0}, "acc_steps: expected an int >= 1"),
                                      ({"acc_steps": 1e300}, "acc_steps: expected an int >= 1"),
                                      ({"acc_steps": 10 ** 30}, "acc_steps: expected an int >= 1"),
                                      ({"acc_steps": True}, "acc_steps: expected an int >= 1"),
                                      ({"id": "x"}, "id: expected an int, got 'x'"),
                                      ({"id": 1.5}, "id: expected an int, got 1.5")])
def test_acc_steps_and_id_are_ints(kw, what):
    """A float acc_steps was compared as a float (1e300 accepted); a string id hashes
    differently on every rank, so the order check would fail every collective."""
    p = Param("w", np.zeros(4, np.float32))
    args = dict(id=0, params=[p], comm_group=MPI.COMM_SELF, act="all_reduce")
    args.update(kw)
    with pytest.raises((OptionError, LayoutError), match=re.escape(what)):
        FusedCommBuffer(**args)
    ok = FusedCommBuffer(np.int64(3), [Param("v", np.zeros(4, np.float32))], MPI.COMM_SELF,
                         acc_steps=np.int32(2), act="all_reduce")
    assert ok.id == 3 and ok.acc_steps == 2 and type(ok.id) is int


# ------------------------------------ grads, params and switches of add_grad and the storage calls


SELF = MPI.COMM_SELF


def make(acc_steps=2, **kw):
    ps = [Param("w0", np.zeros(4, np.float32)), Param("w1", np.zeros((2, 2), np.float32))]
    return FusedCommBuffer(0, ps, SELF, act="all_reduce", acc_steps=acc_steps, **kw), ps


# ---------------------------------------------------------------------------------------- use_comm
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


# ------------------------------------------------------------------------------------- grad values
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


# ----------------------------------------------------------------------------------- rebound grads
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


# ----------------------------------------------------------------------------------- release_grads
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


# ---------------------------------------------------- under mpiexec: dtypes and float64 main grads


@pytest.mark.matrix
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.complex64, np.bool_],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act", ["all_reduce", "reduce", "reduce_scatter"])
def test_non_float_params_refused_on_every_rank(comm, dtype, act):
    p = Param("w", np.zeros(4, dtype))
    with pytest.raises(LayoutError, match=rf"^rank {comm.Get_rank()}: param 'w': dtype "
                                          rf"{np.dtype(dtype).name} cannot be fused; expected "
                                          rf"one of float64, float32, bfloat16, float16$"):
        FusedCommBuffer(0, [p], comm, act=act, dst=0 if act == "reduce" else -1)
    assert p.grad is None
    # the communicator is still usable: a float buffer built after it reduces correctly
    q = Param("v", np.zeros(4, np.float32))
    buf = FusedCommBuffer(1, [q], comm, act="all_reduce")
    buf.add_grad(q, grad=np.full(4, comm.Get_rank() + 1.0, np.float32))
    buf.scale_grads()
    n = comm.Get_size()
    np.testing.assert_array_equal(q.grad, np.full(4, (n + 1) / 2, np.float32))


@pytest.mark.mpi
def test_fused_parameters_refuses_an_int_param_on_every_rank(comm):
    params = [Param("a", np.zeros(4, np.float32)), Param("step", np.zeros(1, np.int64))]
    with pytest.raises(LayoutError, match=r"param 'step': dtype int64 cannot be fused"):
        fused_parameters(params, comm_group=comm, act="all_reduce", comm_overlap=True)
    assert params[0].grad is None and not params[0]._backward_hooks


@pytest.mark.matrix
@pytest.mark.mpi
@pytest.mark.parametrize("act", ["all_reduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize("avg", [False, True])
def test_float64_main_grads_are_summed_in_float64(comm, act, avg):
    rank, n = comm.Get_rank(), comm.Get_size()
    p = Param("w", np.zeros(64, np.float64), main_grad=np.zeros(64, np.float64))
    buf = FusedCommBuffer(0, [p], comm, act=act, dst=0 if act == "reduce" else -1,
                          use_reduce_avg=avg)
    assert buf.use_main_grad and buf.grad_dtype == np.float64
    tiny = 2.0 ** -40  # lost in fp32: 1 + 2^-40 rounds to 1
    buf.add_grad(p, grad=np.full(64, 1.0 + (rank + 1) * tiny))
    buf.scale_grads()
    total = n + tiny * n * (n + 1) / 2  # exact in float64 for these rank counts
    want = total / n  # scale_after_comm (the default) or use_reduce_avg: the mean
    if act == "reduce_scatter":
        lo, hi = buf.layout.shard_range(rank)
        got = buf.grad_storage[lo:min(hi, 64)]
    elif act == "reduce" and rank != 0:
        return
    else:
        got = p.main_grad
    assert got.dtype == np.float64
    # fp32 would give exactly 1.0, off by tiny * (n + 1) / 2, far beyond this tolerance
    np.testing.assert_allclose(got, want, rtol=4 * 2.0 ** -53 * n, atol=0)


@pytest.mark.mpi
def test_negated_torch_grads_keep_their_sign(comm):
    rank, n = comm.Get_rank(), comm.Get_size()
    if n > 3:  # the sign is read per element, as the grad is added: no rank count changes it
        pytest.skip("runs at 1 to 3 ranks (importing torch on 4 and 8 oversubscribed ranks "
                    "cost 5-10 s a run)")
    torch = pytest.importorskip("torch")
    for dt in (torch.float32, torch.bfloat16):
        p = Param("w", torch.zeros(8, dtype=dt))
        buf = FusedCommBuffer(0, [p], comm, act="all_reduce")
        g = torch._neg_view(torch.full((8,), float(rank + 1), dtype=dt))  # value -(rank+1)
        buf.add_grad(p, grad=g)
        buf.scale_grads()
        np.testing.assert_array_equal(p.grad.astype(np.float64), np.full(8, -(n + 1) / 2))


# ---------------------------------------------------------------- under mpiexec: a positional grad


@pytest.mark.mpi
@pytest.mark.parametrize("act", ["all_reduce", "reduce_scatter"])
def test_a_positional_grad_is_refused_on_every_rank_and_the_step_goes_on(comm, act):
    rank, n = comm.Get_rank(), comm.Get_size()
    p = Param("w", np.zeros(1, np.float32))
    buf = FusedCommBuffer(0, [p], comm, act=act, timeout=60)
    with pytest.raises(OptionError, match=rf"^rank {rank}: buffer 0: param 'w': add_grad: "
                                          rf"use_comm: expected True or False"):
        buf.add_grad(p, np.full(1, float(rank), np.float32))
    assert buf.checked_in == 0 and buf.task is None and not buf.grad_storage.any()
    buf.add_grad(p, grad=np.full(1, float(rank + 1), np.float32))
    buf.scale_grads()
    if act == "all_reduce" or rank == 0:  # w[0] lies in rank 0's shard
        assert float(p.grad[0]) == (n + 1) / 2
