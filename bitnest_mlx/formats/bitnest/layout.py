"""What a bitnest package is made of: file names, Linear names and shapes, the error type.

Shared by the reader and the writer. Spec: docs/bitnest-package.md.
"""

from __future__ import annotations

from ..safetensors_io import FormatError

FORMAT = "bitnest-package-v1"
MANIFEST_NAMES = ("bitnest.json", "manifest.json")
INDEX_NAME = "model.safetensors.index.json"
ARCHS = ("llama", "qwen2")
LAYER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
DEFAULT_EPS = {"llama": 1e-5, "qwen2": 1e-6}
# The manifest's optional integrity block (docs/bitnest-package.md §2.6, formats/checksums.py).
CHECKSUMS_KEY = "checksums"
# The manifest's `norms` block: `smoothing` is interpreted (§2.5); the others are descriptive
# (the seed manifest's). A key outside this list may change the function, so it is refused.
NORMS_KEYS = ("fused", "decoder_norms_identity", "note", "smoothing")


class PackageError(FormatError):
    """A package that breaks bitnest-package-v1; the message names file, tensor, expectation."""


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """[N, K] of every quantized Linear the config dims imply, layers in order, lm_head last."""
    d, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    per_layer = {
        "self_attn.q_proj": (q, d),
        "self_attn.k_proj": (kv, d),
        "self_attn.v_proj": (kv, d),
        "self_attn.o_proj": (d, q),
        "mlp.gate_proj": (inter, d),
        "mlp.up_proj": (inter, d),
        "mlp.down_proj": (d, inter),
    }
    shapes = {
        f"model.layers.{i}.{lin}": s
        for i in range(config["num_hidden_layers"])
        for lin, s in per_layer.items()
    }
    shapes["lm_head"] = (config["vocab_size"], d)
    return shapes


def norm_names(num_layers: int) -> list[str]:
    """The RMSNorm weights a smoothed package stores (§2.5), in forward order, final norm last."""
    return [
        f"model.layers.{i}.{norm}.weight"
        for i in range(num_layers)
        for norm in ("input_layernorm", "post_attention_layernorm")
    ] + ["model.norm.weight"]


# The Linears each norm feeds (their inputs are that norm's output).
NORM_READERS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


def norm_readers(norm: str) -> list[str]:
    """Full names of the Linears reading norm weight `norm` (a name from `norm_names`)."""
    if norm == "model.norm.weight":
        return ["lm_head"]
    prefix, kind, _ = norm.rsplit(".", 2)
    return [f"{prefix}.{lin}" for lin in NORM_READERS[kind]]
