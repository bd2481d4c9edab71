"""Inputs that used to be taken and give a wrong or late answer, one rank (COMM_SELF):

* on/off options read by truthiness (``use_reduce_avg="False"`` turned averaging on);
* numpy integers refused as REDUCE's ``dst``;
* float64 params with main grads rounded to an fp32 grad buffer;
* int/bool/complex params accepted, then failing inside the collective (a KeyError text);
* ``MPI.COMM_NULL`` as ``comm_group`` failing inside MPI with no rank.
"""
import re

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import (FusedCommBuffer, LayoutError, OptionError, Param, fused_parameters,
                       obtain_storage)
from mpifusion.dtypes import ITEMSIZES, bfloat16
from mpifusion.plan.grouping import PlanError, grad_dtype_name, plan_model, split_params
from mpifusion.plan.layout import FUSABLE_DTYPES, TensorMeta, check_fusable, plan_flat
from mpifusion.runtime.options import SWITCHES, check_comm_group, check_switch


def _param(name="w", dtype=np.float32, **kw):
    return Param(name, np.zeros(4, dtype), **kw)


# --------------------------------------------------------------------------- on/off options
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
    """The red-team case: each of these was taken as True."""
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


# --------------------------------------------------------------------------- dst
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


# --------------------------------------------------------------------------- float64 main grads
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


# --------------------------------------------------------------------------- param dtypes
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


# --------------------------------------------------------------------------- comm_group
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
