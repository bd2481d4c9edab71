"""Built-in model presets: parameter names and shapes of real models.

Only shapes are embedded (nothing is downloaded), so layouts and
communication patterns of well-known models can be reproduced offline.
Names and order follow ``model.named_parameters()`` of the reference
framework, because fusion buckets depend on parameter order.
"""

from __future__ import annotations

import math
from typing import Callable

from .dtypes import ALIAS_NAMES
from .errors import FusionError

__all__ = [
    "BASE_PRESETS",
    "PRESETS",
    "PresetError",
    "describe_presets",
    "get_preset",
]

Shape = list[int]
_Entry = tuple[str, Shape]


class PresetError(FusionError, KeyError, ValueError):
    """Unknown preset or dtype; a KeyError for lookups, a ValueError for CLIs."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def _linear(prefix: str, n_in: int, n_out: int, bias: bool = True) -> list[_Entry]:
    """torch.nn.Linear stores its weight as [out, in]."""
    out = [(f"{prefix}.weight", [n_out, n_in])]
    return out + [(f"{prefix}.bias", [n_out])] if bias else out


def _norm(prefix: str, n: int, bias: bool = True) -> list[_Entry]:
    out = [(f"{prefix}.weight", [n])]
    return out + [(f"{prefix}.bias", [n])] if bias else out


def _tiny() -> list[_Entry]:
    # Deliberately odd sizes: primes, a 1-element scale, bias-only tails,
    # so that padding/alignment bugs show up with a handful of ranks.
    return [
        ("embed.weight", [97, 17]),
        *_linear("fc1", 17, 257),                 # weight [257, 17]
        *_norm("norm", 257),
        ("proj.weight", [17, 257]),
        *_linear("fc2", 257, 31),
        ("logit_scale", [1]),
        *_linear("head", 31, 3),
    ]


def _gpt2_small() -> list[_Entry]:
    # HF GPT2LMHeadModel minus lm_head.weight (tied to wte); Conv1D weights
    # are stored [in, out], unlike nn.Linear.
    d, ff = 768, 3072
    out: list[_Entry] = [("transformer.wte.weight", [50257, d]),
                         ("transformer.wpe.weight", [1024, d])]
    for i in range(12):
        p = f"transformer.h.{i}"
        out += [
            *_norm(f"{p}.ln_1", d),
            (f"{p}.attn.c_attn.weight", [d, 3 * d]), (f"{p}.attn.c_attn.bias", [3 * d]),
            (f"{p}.attn.c_proj.weight", [d, d]), (f"{p}.attn.c_proj.bias", [d]),
            *_norm(f"{p}.ln_2", d),
            (f"{p}.mlp.c_fc.weight", [d, ff]), (f"{p}.mlp.c_fc.bias", [ff]),
            (f"{p}.mlp.c_proj.weight", [ff, d]), (f"{p}.mlp.c_proj.bias", [d]),
        ]
    return out + _norm("transformer.ln_f", d)


def _bert_base() -> list[_Entry]:
    # HF BertModel (with pooler, without any task head).
    d, ff = 768, 3072
    out: list[_Entry] = [
        ("embeddings.word_embeddings.weight", [30522, d]),
        ("embeddings.position_embeddings.weight", [512, d]),
        ("embeddings.token_type_embeddings.weight", [2, d]),
        *_norm("embeddings.LayerNorm", d),
    ]
    for i in range(12):
        p = f"encoder.layer.{i}"
        out += [
            *_linear(f"{p}.attention.self.query", d, d),
            *_linear(f"{p}.attention.self.key", d, d),
            *_linear(f"{p}.attention.self.value", d, d),
            *_linear(f"{p}.attention.output.dense", d, d),
            *_norm(f"{p}.attention.output.LayerNorm", d),
            *_linear(f"{p}.intermediate.dense", d, ff),
            *_linear(f"{p}.output.dense", ff, d),
            *_norm(f"{p}.output.LayerNorm", d),
        ]
    return out + _linear("pooler.dense", d, d)


def _resnet50() -> list[_Entry]:
    # torchvision.models.resnet50: Bottleneck blocks [3, 4, 6, 3], expansion 4,
    # bias-free convs, downsample (conv 1x1 + BN) on each stage's first block.
    out: list[_Entry] = [("conv1.weight", [64, 3, 7, 7]), *_norm("bn1", 64)]
    inplanes = 64
    for stage, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], 1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            out += [
                (f"{p}.conv1.weight", [planes, inplanes, 1, 1]), *_norm(f"{p}.bn1", planes),
                (f"{p}.conv2.weight", [planes, planes, 3, 3]), *_norm(f"{p}.bn2", planes),
                (f"{p}.conv3.weight", [planes * 4, planes, 1, 1]), *_norm(f"{p}.bn3", planes * 4),
            ]
            if b == 0:
                out += [(f"{p}.downsample.0.weight", [planes * 4, inplanes, 1, 1]),
                        *_norm(f"{p}.downsample.1", planes * 4)]
            inplanes = planes * 4
    return out + _linear("fc", 2048, 1000)


def _llama_layer() -> list[_Entry]:
    # One HF LlamaDecoderLayer of LLaMA-7B: bias-free projections, RMSNorm.
    d, ff, p = 4096, 11008, "model.layers.0"
    return [
        *_linear(f"{p}.self_attn.q_proj", d, d, bias=False),
        *_linear(f"{p}.self_attn.k_proj", d, d, bias=False),
        *_linear(f"{p}.self_attn.v_proj", d, d, bias=False),
        *_linear(f"{p}.self_attn.o_proj", d, d, bias=False),
        *_linear(f"{p}.mlp.gate_proj", d, ff, bias=False),
        *_linear(f"{p}.mlp.up_proj", d, ff, bias=False),
        *_linear(f"{p}.mlp.down_proj", ff, d, bias=False),
        *_norm(f"{p}.input_layernorm", d, bias=False),
        *_norm(f"{p}.post_attention_layernorm", d, bias=False),
    ]


_BUILDERS: dict[str, Callable[[], list[_Entry]]] = {
    "tiny": _tiny,
    "gpt2-small": _gpt2_small,
    "bert-base": _bert_base,
    "resnet50": _resnet50,
    "llama-layer": _llama_layer,
}

# Name suffix -> dtype of every parameter (half-precision variants are meant
# to be run with fp32 main grads; that choice belongs to the runner).
_SUFFIXES = {"": "float32", "-bf16": "bfloat16", "-fp16": "float16"}
#: the names of the dtypes a preset may take (``mpifusion.dtypes``' one alias table)
_DTYPE_ALIASES = {alias: canon for alias, canon in ALIAS_NAMES.items()
                  if canon in set(_SUFFIXES.values())}

BASE_PRESETS: tuple[str, ...] = tuple(_BUILDERS)
PRESETS: tuple[str, ...] = tuple(b + s for b in BASE_PRESETS for s in _SUFFIXES)


def _resolve(name: str) -> tuple[str, str]:
    """Split a (possibly suffixed) preset name into (base, dtype)."""
    if isinstance(name, str):
        for suffix, dtype in _SUFFIXES.items():
            if suffix and name.endswith(suffix) and name[: -len(suffix)] in _BUILDERS:
                return name[: -len(suffix)], dtype
        if name in _BUILDERS:
            return name, "float32"
    raise PresetError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")


def get_preset(name: str, dtype: str | None = None) -> list[dict]:
    """Return fresh ``{"name", "shape", "dtype"}`` dicts for a preset.

    ``dtype`` overrides the dtype implied by the name suffix; all parameters
    share one dtype to keep mixed-precision runs easy to reason about.
    """
    base, implied = _resolve(name)
    if dtype is None:
        dtype = implied
    elif not isinstance(dtype, str) or dtype.lower() not in _DTYPE_ALIASES:
        valid = ", ".join(sorted(_DTYPE_ALIASES))
        raise PresetError(f"unknown preset dtype {dtype!r}; valid dtypes: {valid}")
    else:
        dtype = _DTYPE_ALIASES[dtype.lower()]
    return [{"name": n, "shape": list(s), "dtype": dtype} for n, s in _BUILDERS[base]()]


def describe_presets() -> list[tuple[str, int, int]]:
    """(name, number of tensors, number of elements) for each base preset, for ``--help``-style listings."""
    rows = []
    for name in BASE_PRESETS:
        shapes = [s for _, s in _BUILDERS[name]()]
        rows.append((name, len(shapes), sum(math.prod(s) for s in shapes)))
    return rows
