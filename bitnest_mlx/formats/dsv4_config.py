"""DeepSeek-V4 bundle config.json validation: every value the schedule, the model and its RoPE
tables read, with its type and range (`check_config`), and the bundle's error type."""

from __future__ import annotations

import math
from pathlib import Path

from . import safetensors_io


class BundleError(safetensors_io.FormatError):
    """A bundle that does not match its config's schedule."""


# Every config value the schedule, the model and its RoPE tables read, with its type and range,
# so that an edited config.json is refused here in one line instead of failing inside mlx-lm's
# RoPE code or the model (or building a model of another shape).
_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
)
_OPTIONAL_POSITIVE_INTS = (
    "n_shared_experts",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
    "hc_sinkhorn_iters",
    "max_position_embeddings",
)
_OPTIONAL_NUMBERS = {  # key: (lower bound, bound included)
    "rms_norm_eps": (0.0, False),
    "hc_eps": (0.0, True),
    "routed_scaling_factor": (0.0, False),
    "swiglu_limit": (0.0, True),
    "rope_theta": (1.0, False),  # YaRN divides by log(theta)
    "compress_rope_theta": (1.0, False),
}
_YARN_NUMBERS = ("factor", "beta_fast", "beta_slow")
_MAX_INT = 2**31 - 1
_MAX_SINKHORN = 1000
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def check_config(config: dict, f: Path) -> None:
    """BundleError naming config.json, the key and what was expected, for any value the model
    cannot be built from (types, ranges and the relations between dims)."""

    def bad(key: str, expected: str) -> BundleError:
        found = f"= {config[key]!r}" if key in config else "missing"
        return BundleError(f"{f}: {key} {found}, expected {expected}")

    for key in _POSITIVE_INTS:
        if not (is_int(config.get(key)) and 0 < config[key] <= _MAX_INT):
            raise bad(key, f"a positive integer <= {_MAX_INT} (MLX indexes with int32)")
    for key in _OPTIONAL_POSITIVE_INTS:
        if key in config and not (is_int(config[key]) and 0 < config[key] <= _MAX_INT):
            raise bad(key, f"a positive integer <= {_MAX_INT} (MLX indexes with int32)")
    # Past these the model is no longer a model but a hang (Sinkhorn steps unrolled into the
    # graph) or an int32 overflow (window positions).
    if config.get("hc_sinkhorn_iters", 20) > _MAX_SINKHORN:
        raise bad("hc_sinkhorn_iters", f"at most {_MAX_SINKHORN} (the reference uses 20)")
    context = config.get("max_position_embeddings", 1048576)
    for key in ("sliding_window", "index_topk"):
        if config.get(key, 1) > context:
            raise bad(key, f"at most max_position_embeddings {context}")
    if not (is_int(config.get("num_hash_layers", 0)) and config.get("num_hash_layers", 0) >= 0):
        raise bad("num_hash_layers", "an integer >= 0")
    for key, (low, inclusive) in _OPTIONAL_NUMBERS.items():
        v = config.get(key, low + 1)
        if not (_is_number(v) and (v >= low if inclusive else v > low)):
            raise bad(key, f"a finite number {'>=' if inclusive else '>'} {low:g}")
    if config.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise bad("scoring_func", "'sqrtsoftplus' (the only router this model implements)")
    if config.get("tie_word_embeddings", False) is not False:
        raise bad("tie_word_embeddings", "false (DeepSeek-V4 has an untied head)")
    n = config["num_hidden_layers"]
    ratios = config.get("compress_ratios")
    if not (
        isinstance(ratios, list)
        and len(ratios) >= n
        and all(is_int(r) and r in (0, 4, 128) for r in ratios[:n])
    ):
        raise bad("compress_ratios", f"a list of at least {n} entries, each 0, 4 or 128")
    rope, hd = config["qk_rope_head_dim"], config["head_dim"]
    if rope % 2 or rope > hd:
        raise bad("qk_rope_head_dim", f"an even number <= head_dim {hd}")
    if 4 in ratios[:n] and config.get("index_head_dim", 128) < rope:
        raise bad("index_head_dim", f"at least qk_rope_head_dim {rope} (the indexer's RoPE)")
    if (config["num_attention_heads"] * hd) % config["o_groups"]:
        raise bad("o_groups", "a divisor of num_attention_heads * head_dim")
    if config["num_experts_per_tok"] > config["n_routed_experts"]:
        raise bad("num_experts_per_tok", f"at most n_routed_experts {config['n_routed_experts']}")
    for key in ("rope_parameters", "rope_scaling"):
        _check_rope(config, key, f)
    _check_quantization(config.get("quantization"), f)
    for holder in (config, config.get("quantization") or {}):
        plan = holder.get("routed_expert_bit_plan")
        assignment = plan.get("assignment") if isinstance(plan, dict) else None
        if not (
            plan is None
            or isinstance(plan, dict)
            and (
                assignment is None
                or isinstance(assignment, dict)
                and all(is_int(b) for b in assignment.values())
            )
        ):
            raise BundleError(
                f"{f}: routed_expert_bit_plan = {plan!r}, expected an object whose 'assignment' "
                "maps layer_L.<proj> to integer bits"
            )
    if "mxtq_seed" in config and not (is_int(config["mxtq_seed"]) and config["mxtq_seed"] >= 0):
        raise bad("mxtq_seed", "an integer >= 0")
    eos = config.get("eos_token_id")
    if not (eos is None or is_int(eos) or isinstance(eos, list) and all(map(is_int, eos))):
        raise bad("eos_token_id", "an integer, a list of integers or null")


def _check_rope(config: dict, key: str, f: Path) -> None:
    rope = config.get(key)
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise BundleError(f"{f}: {key} = {rope!r}, expected an object or null")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("yarn", "default"):
        raise BundleError(f"{f}: {key}.rope_type = {kind!r}, expected 'yarn' or 'default'")
    for field_name in _YARN_NUMBERS:
        v = rope.get(field_name, 1)
        if not (_is_number(v) and v > 0):
            raise BundleError(f"{f}: {key}.{field_name} = {v!r}, expected a positive number")
    v = rope.get("original_max_position_embeddings", 1)
    if not (is_int(v) and v > 0):
        raise BundleError(
            f"{f}: {key}.original_max_position_embeddings = {v!r}, expected a positive integer"
        )


def _check_quantization(q: object, f: Path) -> None:
    """The affine block: bits and group size at the top and per module."""
    if q is None:
        return
    if not isinstance(q, dict):
        raise BundleError(f"{f}: quantization = {q!r}, expected an object or null")
    for where, block in [("quantization", q)] + [
        (f"quantization.{k}", v) for k, v in q.items() if isinstance(v, dict)
    ]:
        if where == "quantization.routed_expert_bit_plan":
            continue
        for key, allowed in (("bits", AFFINE_BITS), ("group_size", AFFINE_GROUPS)):
            if key in block and not (is_int(block[key]) and block[key] in allowed):
                raise BundleError(f"{f}: {where}.{key} = {block[key]!r}, expected one of {allowed}")
