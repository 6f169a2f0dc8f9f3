"""The DeepSeek-V4 bundle layout a config implies: every logical tensor (`schedule`), where jang
stores routed experts, and the float dtype rule (spec: docs/deepseek-v4-spec.md §10-§11).

The schedule reads a validated `DSV4Config` (formats/dsv4_config.py), so its dimensions and
defaults are the model's own; the reader (dsv4_bundle.py) and the writer
(dsv4_bundle_write.py) both take their key lists from here, and models/deepseek_v4.py builds
every parameter at the shape its slot gives (`Model.check_declared` fails at construction on
any difference), so each tensor's name and shape is written here only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

from .dsv4_config import BundleError, DSV4Config

PROJECTIONS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}  # official expert names
FLOATS = (mx.float16, mx.bfloat16, mx.float32)
INTS = (mx.int8, mx.int16, mx.int32, mx.int64, mx.uint8, mx.uint16, mx.uint32, mx.uint64)


@dataclass(frozen=True)
class Slot:
    """One logical tensor of the model.

    kind: "linear" ([out, in], float or affine), "embedding" (same storage), "experts"
    ([E, out, in], MXTQ or float), "float" (passthrough) or "int" (tid2eid).
    """

    kind: str
    shape: tuple[int, ...]


# ---------------------------------------------------------------- schedule


def schedule(config: dict | DSV4Config) -> dict[str, Slot]:
    """Every logical tensor the config's layer schedule implies, by model parameter name (a dict
    is validated first: dsv4_config.DSV4Config holds the fields and their defaults)."""
    c = config if isinstance(config, DSV4Config) else DSV4Config.from_dict(config)
    d, v, hc = c.hidden_size, c.vocab_size, c.hc_mult
    heads, hd = c.num_attention_heads, c.head_dim
    q_lora, o_lora, groups = c.q_lora_rank, c.o_lora_rank, c.o_groups
    inter, experts = c.moe_intermediate_size, c.n_routed_experts
    shared = inter * c.n_shared_experts
    ih, idim = c.index_n_heads, c.index_head_dim
    n_layers, ratios = c.num_hidden_layers, c.compress_ratios
    mix = (2 + hc) * hc

    s: dict[str, Slot] = {
        "embed": Slot("embedding", (v, d)),
        "head": Slot("linear", (v, d)),
        "norm.weight": Slot("float", (d,)),
        "hc_head_fn": Slot("float", (hc, hc * d)),
        "hc_head_base": Slot("float", (hc,)),
        "hc_head_scale": Slot("float", (1,)),
    }
    for i in range(n_layers):
        p, r = f"layers.{i}", ratios[i]
        s.update(
            {
                f"{p}.attn_norm.weight": Slot("float", (d,)),
                f"{p}.ffn_norm.weight": Slot("float", (d,)),
                f"{p}.attn.wq_a": Slot("linear", (q_lora, d)),
                f"{p}.attn.q_norm.weight": Slot("float", (q_lora,)),
                f"{p}.attn.wq_b": Slot("linear", (heads * hd, q_lora)),
                f"{p}.attn.wkv": Slot("linear", (hd, d)),
                f"{p}.attn.kv_norm.weight": Slot("float", (hd,)),
                f"{p}.attn.wo_a": Slot("linear", (groups * o_lora, heads * hd // groups)),
                f"{p}.attn.wo_b": Slot("linear", (d, groups * o_lora)),
                f"{p}.attn.attn_sink": Slot("float", (heads,)),
                f"{p}.ffn.gate.weight": Slot("float", (experts, d)),
                f"{p}.ffn.shared_experts.w1": Slot("linear", (shared, d)),
                f"{p}.ffn.shared_experts.w2": Slot("linear", (d, shared)),
                f"{p}.ffn.shared_experts.w3": Slot("linear", (shared, d)),
                f"{p}.ffn.switch_mlp.gate_proj": Slot("experts", (experts, inter, d)),
                f"{p}.ffn.switch_mlp.up_proj": Slot("experts", (experts, inter, d)),
                f"{p}.ffn.switch_mlp.down_proj": Slot("experts", (experts, d, inter)),
            }
        )
        for site in ("attn", "ffn"):
            s[f"{p}.hc_{site}_fn"] = Slot("float", (mix, hc * d))
            s[f"{p}.hc_{site}_base"] = Slot("float", (mix,))
            s[f"{p}.hc_{site}_scale"] = Slot("float", (3,))
        if i < c.num_hash_layers:
            s[f"{p}.ffn.gate.tid2eid"] = Slot("int", (v, c.num_experts_per_tok))
        else:
            s[f"{p}.ffn.gate.bias"] = Slot("float", (experts,))
        if r:
            s.update(_compressor(f"{p}.attn.compressor", r, hd, d))
        if r == 4:
            s[f"{p}.attn.indexer.wq_b"] = Slot("linear", (ih * idim, q_lora))
            s[f"{p}.attn.indexer.weights_proj"] = Slot("linear", (ih, d))
            s.update(_compressor(f"{p}.attn.indexer.compressor", 4, idim, d))
    return s


def _compressor(prefix: str, ratio: int, head_dim: int, d: int) -> dict[str, Slot]:
    width = head_dim * (2 if ratio == 4 else 1)
    return {
        f"{prefix}.wkv": Slot("linear", (width, d)),
        f"{prefix}.wgate": Slot("linear", (width, d)),
        f"{prefix}.ape": Slot("float", (ratio, width)),
        f"{prefix}.norm.weight": Slot("float", (head_dim,)),
    }


def layer_proj(name: str) -> tuple[str, str]:
    """("L", "<proj>") of a routed-expert slot `layers.L.ffn.switch_mlp.<proj>`."""
    return name.split(".")[1], name.rsplit(".", 1)[1]


def plan_key(name: str) -> str:
    """The `routed_expert_bit_plan` key of a routed-expert slot: "layer_L.<proj>"."""
    layer, proj = layer_proj(name)
    return f"layer_{layer}.{proj}"


def stored_expert_name(name: str, expert: int | None = None) -> str:
    """Where jang stores a routed-expert slot: pre-stacked under `layers.L.mlp.switch_mlp.<proj>`,
    or, given `expert`, under the official per-expert `layers.L.ffn.experts.E.w{1,2,3}`."""
    layer, proj = layer_proj(name)
    if expert is None:
        return f"layers.{layer}.mlp.switch_mlp.{proj}"
    return f"layers.{layer}.ffn.experts.{expert}.{PROJECTIONS[proj]}"


# Float tensors of one family share one dtype in a bundle (jang: float32 hc_*, sinks, ape and
# router biases, float16 norms, router weights and affine scales/biases; our float writer:
# float32; a dequantized official checkpoint: bfloat16). First match wins.
_FLOAT_FAMILIES = tuple(
    (family, re.compile(pattern))
    for family, pattern in (
        ("norm weights", r"norm\.weight$"),
        ("hc_* tensors", r"(^|\.)hc_"),
        ("attention sinks", r"attn_sink$"),
        ("compressor ape", r"\.ape$"),
        ("router weights", r"gate\.weight$"),
        ("router biases", r"gate\.bias$"),
        ("affine scales and biases", r"\.(scales|biases)$"),
        ("float weights", r"\.weight$"),
    )
)


def check_float_families(out: dict[str, mx.array]) -> None:
    """A float tensor stored in another float dtype than its family's (set by the family's first
    tensor in schedule order) is refused, not cast: the model would read other values than
    were written (a float32 tensor narrowed to float16, say) and nothing else would tell."""
    first: dict[str, tuple[str, mx.Dtype]] = {}
    for name, a in out.items():
        if a.dtype not in FLOATS:
            continue
        family = next((f for f, rx in _FLOAT_FAMILIES if rx.search(name)), None)
        if family is None:
            continue
        seen, dtype = first.setdefault(family, (name, a.dtype))
        if a.dtype != dtype:
            raise BundleError(
                f"{name}: dtype {a.dtype}, expected {dtype} like {seen} (the bundle's {family} "
                "share one float dtype; another is refused, not cast)"
            )
