"""Spec files and ``Spec``: fields, defaults, errors naming the field, presets, and hostile
files (FIFOs, deep nesting, huge integers, random JSON) that are one-line spec errors.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpifusion.limits import open_regular
from mpifusion.presets import PRESETS, PresetError
from mpifusion.spec import (DEFAULT_GROUP_SIZE, ParamSpec, Spec, SpecError, load_spec,
                            normalize_dtype)

from tests.forge import FUZZ, refused_without_blocking

BASE = {
    "params": [
        {"name": "w0", "shape": [17, 257], "dtype": "float32"},
        {"name": "b0", "shape": [257], "dtype": "float32"},
        {"name": "s", "shape": [1], "dtype": "float32"},
        {"name": "w1", "shape": [3, 5], "dtype": "float32"},
    ],
    "act": "reduce",
    "nranks": 4,
    "dst": 2,
}


def base(**changes):
    d = copy.deepcopy(BASE)
    d.update(changes)
    return d


def with_param(i, **changes):
    d = base()
    d["params"][i].update(changes)
    return d


def error(d, source="spec.json"):
    with pytest.raises(SpecError) as info:
        Spec.from_dict(d, source=source)
    return str(info.value)


def test_defaults():
    s = Spec.from_dict({"params": [{"name": "w", "shape": [2, 3], "dtype": "fp16"}]})
    assert s.act == "all_reduce" and s.nranks is None and s.group_size == DEFAULT_GROUP_SIZE == 268435456
    assert (s.use_main_grad, s.acc_steps, s.dst, s.average) == (False, 1, -1, False)
    assert s.params == (ParamSpec("w", (2, 3), "float16", True, False, False, True, False),)
    assert s.numel == 6 and s.params[0].nbytes == 12


def test_full_spec():
    d = base(group_size=0, use_main_grad=True, acc_steps=4, average=True)
    d["params"][0].update(trainable=False, stop_gradient=True, is_distributed=True, need_clip=False, decay=True)
    s = Spec.from_dict(d)
    p = s.params[0]
    assert (p.trainable, p.stop_gradient, p.is_distributed, p.need_clip, p.decay) == (False, True, True, False, True)
    assert (s.act, s.nranks, s.group_size, s.use_main_grad, s.acc_steps, s.dst, s.average) == (
        "reduce", 4, 0, True, 4, 2, True)
    assert isinstance(s.params, tuple) and isinstance(p.shape, tuple)


def test_frozen_params_are_not_fused():
    """Paddle's trainable is not stop_gradient: either flag keeps a param out of the buffers."""
    d = base()
    d["params"][0]["trainable"] = False
    d["params"][1]["stop_gradient"] = True
    s = Spec.from_dict(d)
    names = [p.name for p in s.params]
    assert [p.name for p in s.fused_params()] == names[2:]
    assert all(p.name in names[2:] for b in s.plan() for p in b.params)


@pytest.mark.parametrize("alias,canon", [
    ("float16", "float16"), ("fp16", "float16"), ("half", "float16"),
    ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), ("BF16", "bfloat16"),
    ("float32", "float32"), ("fp32", "float32"), ("float", "float32"),
    ("float64", "float64"), ("fp64", "float64"), ("double", "float64"),
])
def test_dtype_aliases(alias, canon):
    assert normalize_dtype(alias) == canon
    assert Spec.from_dict(with_param(0, dtype=alias)).params[0].dtype == canon


def test_scalar_and_empty_shapes_allowed():
    s = Spec.from_dict({"params": [{"name": "a", "shape": [], "dtype": "fp32"},
                                   {"name": "b", "shape": [0, 3], "dtype": "fp32"}]})
    assert [p.numel for p in s.params] == [1, 0]


@pytest.mark.parametrize("d,expected", [
    ([], 'spec.json: expected a JSON object at the top level, got []'),
    ("x", 'spec.json: expected a JSON object at the top level, got "x"'),
    ({}, 'spec.json: missing required key "params"'),
    (base(params={}), "spec.json: params: expected a list of parameter objects, got {}"),
    (base(params=None), "spec.json: params: expected a list of parameter objects, got null"),
    (base(params=[]), "spec.json: params: must contain at least one parameter"),
    (base(params=[3]), "spec.json: params[0]: expected an object, got 3"),
    (base(bogus=1), 'spec.json: unknown key "bogus"'),
    (base(grup_size=1), 'spec.json: unknown key "grup_size" (did you mean "group_size"?)'),
    (with_param(2, shap=[1]), 'spec.json: params[2]: unknown key "shap" (did you mean "shape"?)'),
    (base(act="allreduce"), 'spec.json: act: expected one of "all_reduce", "reduce", "reduce_scatter", got "allreduce"'),
    (base(act=None), "spec.json: act: expected one of"),
    (base(nranks=0), "spec.json: nranks: expected an int >= 1, got 0"),
    (base(nranks=True), "spec.json: nranks: expected an int >= 1, got true"),
    (base(nranks=4.0), "spec.json: nranks: expected an int >= 1, got 4.0"),
    (base(nranks="4"), 'spec.json: nranks: expected an int >= 1, got "4"'),
    (base(group_size=-1), "spec.json: group_size: expected an int >= 0, got -1"),
    (base(group_size=False), "spec.json: group_size: expected an int >= 0, got false"),
    (base(acc_steps=0), "spec.json: acc_steps: expected an int >= 1, got 0"),
    (base(use_main_grad=1), "spec.json: use_main_grad: expected true or false, got 1"),
    (base(average="true"), 'spec.json: average: expected true or false, got "true"'),
    (base(dst=4), 'spec.json: dst: act "reduce" needs a destination rank in [0, nranks=4), got 4'),
    (base(dst=-1), 'spec.json: dst: act "reduce" needs a destination rank in [0, nranks=4), got -1'),
    (base(dst=True), "spec.json: dst: expected an int, got true"),
    (base(dst=1.5), "spec.json: dst: expected an int, got 1.5"),
    ({k: v for k, v in base().items() if k != "dst"}, 'spec.json: dst: act "reduce" needs a destination rank'),
    (base(act="all_reduce", dst=9), "spec.json: dst: expected -1 or a rank in [0, nranks=4), got 9"),
    (with_param(3, shape="abc"), 'spec.json: params[3].shape: expected a list of non-negative ints, got "abc"'),
    (with_param(3, shape=[2, -1]), "spec.json: params[3].shape: expected a list of non-negative ints, got [2, -1]"),
    (with_param(3, shape=[2.0]), "spec.json: params[3].shape: expected a list of non-negative ints, got [2.0]"),
    (with_param(3, shape=[True]), "spec.json: params[3].shape: expected a list of non-negative ints, got [true]"),
    (with_param(3, shape=7), "spec.json: params[3].shape: expected a list of non-negative ints, got 7"),
    (with_param(1, dtype="int8"), 'spec.json: params[1].dtype: unknown dtype "int8"; expected one of'),
    (with_param(1, dtype=32), "spec.json: params[1].dtype: unknown dtype 32"),
    (with_param(1, name=""), 'spec.json: params[1].name: expected a non-empty string, got ""'),
    (with_param(1, name=5), "spec.json: params[1].name: expected a non-empty string, got 5"),
    (with_param(1, name="w\nPASS: 3 params within the bound"),
     "spec.json: params[1].name: expected printable characters only, got "),
    (with_param(1, name="w\x1b[1A"), "spec.json: params[1].name: expected printable characters"),
    (with_param(2, name="w0"), 'spec.json: params[2].name: duplicate name "w0" (first used by params[0])'),
    (with_param(0, trainable=1), "spec.json: params[0].trainable: expected true or false, got 1"),
    (with_param(0, need_clip=None), "spec.json: params[0].need_clip: expected true or false, got null"),
    (with_param(0, decay="no"), 'spec.json: params[0].decay: expected true or false, got "no"'),
])
def test_errors(d, expected):
    assert error(d).startswith(expected)


@pytest.mark.parametrize("key", ["name", "shape", "dtype"])
def test_missing_param_key(key):
    d = base()
    del d["params"][1][key]
    assert error(d) == f'spec.json: params[1]: missing required key "{key}"'


def test_reduce_without_nranks_checks_lower_bound_only():
    assert Spec.from_dict(base(nranks=None, dst=100)).dst == 100
    assert "dst" in error(base(nranks=None, dst=-3))


def test_error_attributes():
    with pytest.raises(SpecError) as info:
        Spec.from_dict(with_param(3, shape="abc"), source="spec.json")
    e = info.value
    assert (e.source, e.path) == ("spec.json", ("params", 3, "shape"))
    assert e.reason.startswith("expected a list")


def test_long_values_are_truncated():
    msg = error(with_param(0, shape=["x" * 500]))
    assert len(msg) < 200 and msg.endswith("...")


def test_roundtrip_and_json():
    s = Spec.from_dict(base(use_main_grad=True, acc_steps=3))
    d = s.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert Spec.from_dict(d) == s
    assert d["params"][0] == {"name": "w0", "shape": [17, 257], "dtype": "float32", "trainable": True,
                              "stop_gradient": False, "is_distributed": False, "need_clip": True, "decay": False}


def test_replace_revalidates():
    s = Spec.from_dict(base())
    assert dataclasses.replace(s, nranks=8).nranks == 8
    with pytest.raises(SpecError, match=r"^dst: "):
        dataclasses.replace(s, nranks=2)
    with pytest.raises(SpecError, match=r"^acc_steps: "):
        dataclasses.replace(s, acc_steps=0)
    with pytest.raises(SpecError, match=r"^params\[1\]\.name: duplicate"):
        dataclasses.replace(s, params=(s.params[0], s.params[0]))
    p = dataclasses.replace(s.params[0], shape=[4, 4], dtype="bf16")
    assert (p.shape, p.dtype) == ((4, 4), "bfloat16")
    with pytest.raises(SpecError, match=r"^shape: "):
        dataclasses.replace(s.params[0], shape=(-1,))
    assert hash(s) == hash(Spec.from_dict(base()))


def test_frozen():
    s = Spec.from_dict(base())
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.act = "reduce_scatter"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.params[0].name = "x"  # type: ignore[misc]


def test_load_spec(tmp_path):
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(base()))
    assert load_spec(f) == Spec.from_dict(base())
    assert load_spec(str(f)).dst == 2


@pytest.mark.parametrize("text,expected", [
    ("", "not valid JSON: Expecting value"),
    ('{"params": [', "not valid JSON"),
    ('{"params": [NaN]}', "not valid JSON: NaN is not allowed"),
    ('{"params": [], "params": []}', 'duplicate key "params"'),
    ("[1, 2]", "expected a JSON object at the top level, got [1, 2]"),
    ('{"params": [{"name": "a", "shape": "abc", "dtype": "fp32"}]}',
     'params[0].shape: expected a list of non-negative ints, got "abc"'),
    ("[" * 100000 + "]" * 100000, "not valid JSON"),
])
def test_load_spec_errors(tmp_path, text, expected):
    f = tmp_path / "spec.json"
    f.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(f)
    msg = str(info.value)
    assert msg.startswith(f"{f}: ") and expected in msg and "\n" not in msg


def test_load_spec_unreadable(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.json")
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path)
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"params": "\xff"}')
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(bad)


@pytest.mark.parametrize("name", PRESETS)
def test_from_preset(name):
    s = Spec.from_preset(name, nranks=8)
    assert s.nranks == 8 and s.act == "all_reduce"
    assert s.use_main_grad is name.endswith(("-bf16", "-fp16"))
    assert {p.dtype for p in s.params} == {"bfloat16" if name.endswith("bf16") else
                                           "float16" if name.endswith("fp16") else "float32"}


def test_from_preset_overrides():
    s = Spec.from_preset("gpt2-small-bf16", use_main_grad=False, act="reduce", nranks=2, dst=1, group_size=1 << 20)
    assert (s.use_main_grad, s.act, s.dst, s.group_size) == (False, "reduce", 1, 1 << 20)
    assert len(s.params) == 148 and s.numel == 124_439_808
    assert Spec.from_preset("tiny", dtype="fp16").use_main_grad is True
    with pytest.raises(SpecError, match=r"^preset tiny: act: "):
        Spec.from_preset("tiny", act="broadcast")
    with pytest.raises(SpecError, match=r"^preset tiny: unknown key \"nrank\""):
        Spec.from_preset("tiny", nrank=2)
    with pytest.raises(PresetError):
        Spec.from_preset("nope")


json_scalars = st.none() | st.booleans() | st.integers(-5, 10) | st.floats(allow_nan=False) | st.text(max_size=8)


json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


PARAM_FLAGS = ["trainable", "stop_gradient", "is_distributed", "need_clip", "decay"]


param_keys = st.sampled_from(["name", "shape", "dtype", *PARAM_FLAGS, "bogus"])


top_keys = st.sampled_from(["params", "act", "nranks", "group_size", "use_main_grad", "acc_steps", "dst",
                            "average", "bogus"])


@st.composite
def valid_spec_dicts(draw):
    names = draw(st.lists(st.text(min_size=1, max_size=4).filter(str.isprintable), min_size=1, max_size=5, unique=True))
    params = []
    for name in names:
        p = {"name": name, "shape": draw(st.lists(st.integers(0, 5), max_size=3)),
             "dtype": draw(st.sampled_from(["fp16", "half", "bf16", "float32", "float", "fp64"]))}
        for flag in draw(st.sets(st.sampled_from(PARAM_FLAGS))):
            p[flag] = draw(st.booleans())
        params.append(p)
    d = {"params": params}
    nranks = draw(st.none() | st.integers(1, 8))
    optional = {
        "act": st.sampled_from(["all_reduce", "reduce", "reduce_scatter"]), "nranks": st.just(nranks),
        "group_size": st.integers(0, 1 << 30), "use_main_grad": st.booleans(), "acc_steps": st.integers(1, 8),
        "average": st.booleans(),
    }
    for key in draw(st.sets(st.sampled_from(sorted(optional)))):
        d[key] = draw(optional[key])
    if d.get("act") == "reduce" or draw(st.booleans()):
        d["dst"] = draw(st.integers(0, (nranks or 100) - 1))
    return d


def check_total(d):
    """Either a Spec that survives a JSON round trip, or a one-line SpecError naming the source."""
    try:
        s = Spec.from_dict(d, source="fuzz.json")
    except SpecError as e:
        msg = str(e)
        assert msg.startswith("fuzz.json: ") and "\n" not in msg
        return None
    assert isinstance(s, Spec)
    assert Spec.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    return s


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_fuzz_any_json(value):
    check_total(value)


@settings(max_examples=300, deadline=None)
@given(valid_spec_dicts())
def test_fuzz_valid_specs_accepted(d):
    assert check_total(d) is not None


@settings(max_examples=600, deadline=None)
@given(valid_spec_dicts(), st.data())
def test_fuzz_one_field_corrupted(d, data):
    if data.draw(st.booleans(), label="corrupt a param"):
        p = data.draw(st.sampled_from(d["params"]), label="param")
        p[data.draw(param_keys, label="key")] = data.draw(json_values, label="value")
    else:
        d[data.draw(top_keys, label="key")] = data.draw(json_values, label="value")
    check_total(d)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(top_keys, json_values, max_size=9))
def test_fuzz_random_top_level(d):
    check_total(d)


# ------------------------------------------------------------------------------ hostile spec files


def test_spec_and_layout_files_must_be_regular(tmp_path):
    fifo = tmp_path / "spec.json"
    os.mkfifo(fifo)
    exc = refused_without_blocking(lambda: load_spec(str(fifo)))
    assert isinstance(exc, SpecError) and "not a regular file (a FIFO)" in str(exc)
    exc = refused_without_blocking(lambda: open_regular("/dev/zero"))
    assert isinstance(exc, OSError) and "character device" in str(exc)


@pytest.mark.parametrize("text, words", [
    ('{"params": [{"name": "w", "shape": [' + "9" * 5000 + '], "dtype": "fp32"}]}',
     "5000 digits"),
    ("[" * 5000 + "]" * 5000, "nested 5000 deep"),
    ('{"params": [{"name": "w", "shape": [1099511627776, 1099511627776], "dtype": "fp32"}]}',
     "2**59 elements"),
    ('{"params": [{"name": "w", "shape": [3], "dtype": "fp32"}], "acc_steps": '
     '99999999999999999999}', "acc_steps"),
])
def test_hostile_spec_files_are_one_line_spec_errors(tmp_path, text, words):
    path = tmp_path / "spec.json"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert words in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith(str(path))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10 ** 30), 10 ** 30) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["params", "name", "shape", "dtype", "act", "nranks", "acc_steps",
                         "group_size", "dst", "average", "x"]), inner, max_size=5),
    max_leaves=30)


@FUZZ
@given(doc=_JSON, depth=st.integers(0, 300), digits=st.integers(1, 6000))
def test_fuzzed_spec_json_is_a_spec_or_one_line_spec_error(tmp_path_factory, doc, depth,
                                                         digits):
    """Random JSON documents, wrapped in ``depth`` lists, and specs with a ``digits``-digit
    size: a Spec or a one-line SpecError, never another exception."""
    folder = tmp_path_factory.mktemp("spec")
    texts = ["[" * depth + json.dumps(doc) + "]" * depth,
             '{"params": [{"name": "w", "shape": [' + "7" * digits + '], "dtype": "fp32"}]}']
    for i, text in enumerate(texts):
        path = folder / f"spec{i}.json"
        path.write_text(text)
        try:
            load_spec(str(path))
        except SpecError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(str(path))
