"""The typed description of a validated package: every field a model needs, read in one place.

`PackageSpec.from_package` is the only code that turns manifest entries into model arguments;
`bitnest_mlx.load` and the mlx-lm plugin both build the model from it (models' ModelArgs extend it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .draft_vocab import draft_vocab_size
from .manifest import weight_group


@dataclass
class PackageSpec:
    arch: str  # "llama" | "qwen2"
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float
    head_dim: int = 128
    group_size: int = 128  # columns per weight scale (manifest `group_size`: 32, 64 or 128)
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    # Linears that carry a bias (full names, "model.layers.0.self_attn.q_proj", ...).
    biased: list[str] = field(default_factory=list)
    # Per layer: the down_proj input's online Hadamard {"K": k, "fp32": bool}, or None.
    r4: list[dict | None] = field(default_factory=list)
    o_proj_group: int = 128  # A8 group of the o_proj input (per head)
    kv_group: int = 128  # KV scale group
    r3: bool = False  # per-head Hadamard of q and k before the cache
    k_bias_offset: bool = False  # K cached without its bias, added back at read time
    smoothing: bool = False  # RMSNorms carry stored weights (per-channel smoothing, §2.5)
    draft_vocab: int = 0  # K: the draft's lm_head keeps K token ids (§2.9); 0: every row

    @classmethod
    def from_package(cls, manifest: dict, config: dict) -> PackageSpec:
        """From a manifest and config that `reader.read` validated."""
        layers = range(config["num_hidden_layers"])
        online = (manifest.get("online_hadamard") or {}).get("layers", {})
        groups = (manifest.get("activation") or {}).get("per_layer_group", {})
        kv = manifest.get("kv") or {}
        head_dim = config["head_dim"]
        dims = {k: config[k] for k in cls.__dataclass_fields__ if k in config}
        return cls(
            **{
                **dims,
                "group_size": weight_group(manifest),
                "biased": [n for n, e in manifest["layers"].items() if e.get("has_bias")],
                "r4": [_r4(online.get(f"model.layers.{i}.mlp.down_proj")) for i in layers],
                "o_proj_group": groups.get("model.layers.0.self_attn.o_proj", head_dim),
                "kv_group": kv.get("group", head_dim),
                "r3": kv.get("r3") is True or kv.get("r3_enabled") is True,
                "k_bias_offset": kv.get("per_channel_offset") == "k_bias",
                "smoothing": (manifest.get("norms") or {}).get("smoothing") is True,
                "draft_vocab": draft_vocab_size(manifest, "bitnest.json"),
            }
        )

    def to_dict(self) -> dict:
        """Plain fields (what mlx-lm style `ModelArgs.from_dict` takes)."""
        return asdict(self)


def _r4(entry: dict | None) -> dict | None:
    """A listed down_proj gets R4 with the format's defaults filled in (K = 1, fp32 off), so
    `{}` means the plain Walsh-Hadamard transform, as the validator reads it; unlisted: none."""
    if entry is None:
        return None
    return {"K": entry.get("K", 1), "fp32": bool(entry.get("fp32", False))}
