import math

import pytest

from mpifusion.presets import BASE_PRESETS, PRESETS, PresetError, describe_presets, get_preset


def numel(params):
    return sum(math.prod(p["shape"]) for p in params)


def shapes(params):
    return {p["name"]: p["shape"] for p in params}


# (tensors, elements) published for the reference models.
EXPECTED = {
    "gpt2-small": (148, 124_439_808),
    "bert-base": (199, 109_482_240),
    "resnet50": (161, 25_557_032),
    "llama-layer": (9, 202_383_360),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_sizes(name):
    params = get_preset(name)
    assert (len(params), numel(params)) == EXPECTED[name]


@pytest.mark.parametrize("name", PRESETS)
def test_well_formed(name):
    params = get_preset(name)
    names = [p["name"] for p in params]
    assert len(set(names)) == len(names)
    for p in params:
        assert set(p) == {"name", "shape", "dtype"}
        assert p["shape"] and all(type(s) is int and s > 0 for s in p["shape"])
        assert p["dtype"] in ("float32", "bfloat16", "float16")
    assert len({p["dtype"] for p in params}) == 1


def test_names_list():
    assert BASE_PRESETS == ("tiny", "gpt2-small", "bert-base", "resnet50", "llama-layer")
    for base in BASE_PRESETS:
        assert {base, base + "-bf16", base + "-fp16"} <= set(PRESETS)
    assert len(PRESETS) == 3 * len(BASE_PRESETS)


def test_tiny_is_small_and_awkward():
    params = get_preset("tiny")
    assert 8 <= len(params) <= 12
    assert numel(params) < 1_000_000
    sizes = [p["shape"] for p in params]
    assert [17, 257] in sizes
    assert any(math.prod(s) == 1 for s in sizes)
    assert any(p["name"].endswith(".bias") for p in params)


def test_gpt2_layout():
    params = get_preset("gpt2-small")
    s = shapes(params)
    assert params[0]["name"] == "transformer.wte.weight" and params[0]["shape"] == [50257, 768]
    assert params[1]["name"] == "transformer.wpe.weight" and params[1]["shape"] == [1024, 768]
    assert [p["name"] for p in params[-2:]] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert "lm_head.weight" not in s  # tied to wte
    # Conv1D stores [in, out]
    assert s["transformer.h.0.attn.c_attn.weight"] == [768, 2304]
    assert s["transformer.h.11.mlp.c_fc.weight"] == [768, 3072]
    assert s["transformer.h.11.mlp.c_proj.weight"] == [3072, 768]
    block = [p["name"].removeprefix("transformer.h.3.") for p in params if p["name"].startswith("transformer.h.3.")]
    assert block == [
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
        "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
        "mlp.c_proj.weight", "mlp.c_proj.bias",
    ]


def test_bert_layout():
    params = get_preset("bert-base")
    s = shapes(params)
    assert [p["name"] for p in params[:5]] == [
        "embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias",
    ]
    assert s["embeddings.word_embeddings.weight"] == [30522, 768]
    assert s["embeddings.token_type_embeddings.weight"] == [2, 768]
    # nn.Linear stores [out, in]
    assert s["encoder.layer.0.intermediate.dense.weight"] == [3072, 768]
    assert s["encoder.layer.11.output.dense.weight"] == [768, 3072]
    assert s["encoder.layer.5.attention.self.value.bias"] == [768]
    assert s["encoder.layer.5.attention.output.LayerNorm.weight"] == [768]
    assert [p["name"] for p in params[-2:]] == ["pooler.dense.weight", "pooler.dense.bias"]
    assert not any(n.startswith("encoder.layer.12.") for n in s)


def test_resnet50_layout():
    params = get_preset("resnet50")
    s = shapes(params)
    assert [p["name"] for p in params[:4]] == ["conv1.weight", "bn1.weight", "bn1.bias", "layer1.0.conv1.weight"]
    assert s["conv1.weight"] == [64, 3, 7, 7]
    assert s["layer1.0.downsample.0.weight"] == [256, 64, 1, 1]
    assert s["layer1.1.conv1.weight"] == [64, 256, 1, 1]
    assert s["layer3.5.conv2.weight"] == [256, 256, 3, 3]
    assert s["layer4.0.downsample.1.bias"] == [2048]
    assert "layer1.1.downsample.0.weight" not in s and "layer3.6.conv1.weight" not in s
    assert [p["name"] for p in params[-2:]] == ["fc.weight", "fc.bias"]
    assert s["fc.weight"] == [1000, 2048]
    block = [p["name"].removeprefix("layer2.0.") for p in params if p["name"].startswith("layer2.0.")]
    assert block == [
        "conv1.weight", "bn1.weight", "bn1.bias", "conv2.weight", "bn2.weight", "bn2.bias",
        "conv3.weight", "bn3.weight", "bn3.bias", "downsample.0.weight", "downsample.1.weight",
        "downsample.1.bias",
    ]


def test_llama_layer_layout():
    params = get_preset("llama-layer")
    p = "model.layers.0."
    assert [(x["name"], x["shape"]) for x in params] == [
        (p + "self_attn.q_proj.weight", [4096, 4096]),
        (p + "self_attn.k_proj.weight", [4096, 4096]),
        (p + "self_attn.v_proj.weight", [4096, 4096]),
        (p + "self_attn.o_proj.weight", [4096, 4096]),
        (p + "mlp.gate_proj.weight", [11008, 4096]),
        (p + "mlp.up_proj.weight", [11008, 4096]),
        (p + "mlp.down_proj.weight", [4096, 11008]),
        (p + "input_layernorm.weight", [4096]),
        (p + "post_attention_layernorm.weight", [4096]),
    ]


@pytest.mark.parametrize("base", BASE_PRESETS)
def test_dtype_variants(base):
    fp32 = get_preset(base)
    assert {p["dtype"] for p in fp32} == {"float32"}
    for suffix, dtype in (("-bf16", "bfloat16"), ("-fp16", "float16")):
        variant = get_preset(base + suffix)
        assert {p["dtype"] for p in variant} == {dtype}
        assert [(p["name"], p["shape"]) for p in variant] == [(p["name"], p["shape"]) for p in fp32]
        assert get_preset(base, dtype) == variant


def test_dtype_argument():
    assert {p["dtype"] for p in get_preset("tiny", "bf16")} == {"bfloat16"}
    assert {p["dtype"] for p in get_preset("tiny", "FP16")} == {"float16"}
    assert {p["dtype"] for p in get_preset("tiny-bf16", "fp32")} == {"float32"}  # explicit dtype wins
    with pytest.raises(PresetError, match="int8"):
        get_preset("tiny", "int8")
    with pytest.raises(PresetError):
        get_preset("tiny", 32)


@pytest.mark.parametrize("bad", ["gpt2", "GPT2-small", "tiny-bf32", "-bf16", "", "tiny-bf16-fp16", None, 3])
def test_unknown_name(bad):
    with pytest.raises(PresetError) as info:
        get_preset(bad)
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KeyError)
    assert "\n" not in msg and not msg.startswith("'")
    for name in PRESETS:
        assert name in msg


def test_results_are_fresh_copies():
    a = get_preset("tiny")
    a[0]["shape"].append(5)
    a[1]["name"] = "x"
    a.pop()
    assert get_preset("tiny")[0]["shape"] == [97, 17]
    assert get_preset("tiny")[1]["name"] == "fc1.weight"
    assert len(get_preset("tiny")) == 11


def test_describe_presets():
    rows = describe_presets()
    assert [r[0] for r in rows] == list(BASE_PRESETS)
    for name, n_params, n_elem in rows:
        params = get_preset(name)
        assert (n_params, n_elem) == (len(params), numel(params))
        if name in EXPECTED:
            assert (n_params, n_elem) == EXPECTED[name]
