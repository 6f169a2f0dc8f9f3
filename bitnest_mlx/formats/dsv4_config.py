"""DeepSeek-V4 config.json: `DSV4Config`, the one list of the fields the model reads (names,
types, ranges, defaults), its validation, the bundle-only keys (`check_config`) and the bundle's
error type.

The model's `ModelArgs` (models/deepseek_v4.py) *is* a `DSV4Config` plus mlx-lm's args protocol,
and the bundle reader's `schedule` reads the same object, so a field, its default and its range
are written here once. It lives in formats/ (rank 0) because the reader must validate a config
before any tensor is read and may not import models/ (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path

from . import safetensors_io


class BundleError(safetensors_io.FormatError):
    """A bundle that does not match its config's schedule."""


MAX_INT = 2**31 - 1  # MLX indexes with int32
COMPRESS_RATIOS = (0, 4, 128)  # sliding only, compressed + indexer, compressed
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _rule(
    default: object = MISSING,
    *,
    ge: int | float | str | None = None,
    gt: float | None = None,
    le: int | str | None = None,
    choices: tuple = (),
    even: bool = False,
    min_len: str | None = None,
    check: Callable[[str, object], str | None] | None = None,
    why: str = "",
) -> dataclasses.Field:
    """A field with its range. `ge`/`le` may name another field (checked once every field's own
    type is right); `choices` applies to each element of a list; `check(name, value)` returns
    what was expected, or None; `why` is appended to the message."""
    meta = dict(ge=ge, gt=gt, le=le, choices=choices, even=even, min_len=min_len, check=check)
    return dataclasses.field(default=default, metadata={**meta, "why": why})


def _positive(default: object = MISSING, **kw) -> dataclasses.Field:
    """A positive int32 (a bound naming another field replaces MAX_INT: that field has it)."""
    return _rule(default, ge=1, **{"le": MAX_INT, **kw})


def _check_rope(name: str, rope: object) -> str | None:
    """rope_parameters / rope_scaling: what mlx-lm's YaRN reads (layers/dsv4_ops.PartialRoPE)."""
    if rope is None:
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("yarn", "default"):
        return f"rope_type 'yarn' or 'default' (found {kind!r})"
    for key in ("factor", "beta_fast", "beta_slow"):
        v = rope.get(key, 1)
        if not (_is_number(v) and v > 0):
            return f"a positive number at {key} (found {v!r})"
    v = rope.get("original_max_position_embeddings", 1)
    if not (is_int(v) and 0 < v <= MAX_INT):
        return f"a positive integer at original_max_position_embeddings (found {v!r})"
    return None


@dataclass
class DSV4Config:
    """Every config.json value the DeepSeek-V4 model and the bundle's layer schedule read.

    A wrong type, a value out of range or a missing required field is a one-line BundleError
    naming config.json, the field and what was expected, raised by `from_dict` (with the file's
    path) and by construction itself, so no value reaches the model or RoPE unchecked.
    """

    vocab_size: int = _positive()
    hidden_size: int = _positive()
    num_hidden_layers: int = _positive()
    num_attention_heads: int = _positive()
    head_dim: int = _positive()
    qk_rope_head_dim: int = _positive(le="head_dim", even=True)
    q_lora_rank: int = _positive()
    o_lora_rank: int = _positive()
    o_groups: int = _positive()
    moe_intermediate_size: int = _positive()
    n_routed_experts: int = _positive()
    num_experts_per_tok: int = _positive(le="n_routed_experts")
    # One entry per layer (entries past num_hidden_layers are MTP layers, not built).
    compress_ratios: list[int] = _rule(choices=COMPRESS_RATIOS, min_len="num_hidden_layers")
    model_type: str = _rule("deepseek_v4", choices=("deepseek_v4",))
    n_shared_experts: int = _positive(1)
    num_hash_layers: int = _rule(0, ge=0, le=MAX_INT)
    routed_scaling_factor: float = _rule(1.0, gt=0.0)
    scoring_func: str = _rule(
        "sqrtsoftplus", choices=("sqrtsoftplus",), why=" (the only router implemented)"
    )
    swiglu_limit: float = _rule(0.0, ge=0.0)
    # Window positions are int32: a window past the context is an overflow, not a model.
    sliding_window: int = _positive(128, le="max_position_embeddings")
    rope_theta: float = _rule(10000.0, gt=1.0, why=" (YaRN divides by its log)")
    compress_rope_theta: float = _rule(10000.0, gt=1.0, why=" (YaRN divides by its log)")
    rope_parameters: dict | None = _rule(None, check=_check_rope)
    rope_scaling: dict | None = _rule(None, check=_check_rope)
    index_n_heads: int = _positive(64)
    index_head_dim: int = _positive(128)
    index_topk: int = _positive(512, le="max_position_embeddings")
    hc_mult: int = _positive(4)
    # Each Sinkhorn step is unrolled into the graph: past this an edited config is a hang.
    hc_sinkhorn_iters: int = _positive(20, le=1000, why=" (the reference uses 20)")
    hc_eps: float = _rule(1e-6, ge=0.0)
    rms_norm_eps: float = _rule(1e-6, gt=0.0)
    max_position_embeddings: int = _positive(1048576)
    tie_word_embeddings: bool = _rule(False, choices=(False,), why=" (V4's head is untied)")

    def __post_init__(self) -> None:
        check_fields(self.__dict__, "config.json")
        self.compress_ratios = list(self.compress_ratios[: self.num_hidden_layers])

    @classmethod
    def from_dict(cls, config: Mapping, source: str | Path = "config.json") -> DSV4Config:
        """The validated fields of a config.json (other keys are ignored); mlx-lm's loader calls
        this on ModelArgs too, so its path is checked the same way."""
        check_fields(config, source)
        return cls(**{f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config})


FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(DSV4Config)
TYPES: dict[str, object] = typing.get_type_hints(DSV4Config)


def expected(f: dataclasses.Field) -> str:
    """What field `f` must hold, in words (the error's "expected ...")."""
    m, kind = f.metadata, TYPES[f.name]
    words = {
        int: "an integer",
        float: "a finite number",
        str: "a string",
        bool: "a boolean",
        list[int]: "a list of integers",
        dict | None: "an object or null",
    }[kind]
    parts = []
    if m["choices"]:
        parts.append(f"{'each ' if kind == list[int] else ''}one of {list(m['choices'])}")
    for key, op in (("ge", ">="), ("gt", ">"), ("le", "<=")):
        if m[key] is not None:
            parts.append(f"{op} {m[key]}")
    if m["even"]:
        parts.append("even")
    if m["min_len"]:
        parts.append(f"at least {m['min_len']} entries")
    return ", ".join([words, *parts]) + m["why"]


def _type_ok(kind: object, v: object) -> bool:
    if kind is int:
        return is_int(v)
    if kind is float:
        return _is_number(v)
    if kind is str:
        return isinstance(v, str)
    if kind is bool:
        return isinstance(v, bool)
    if kind == list[int]:
        return isinstance(v, list) and all(map(is_int, v))
    return v is None or isinstance(v, dict)


def _own_range_ok(f: dataclasses.Field, v: object) -> bool:
    m = f.metadata
    values = v if isinstance(v, list) else [v]
    if m["choices"] and any(x not in m["choices"] for x in values):
        return False
    if isinstance(m["ge"], (int, float)) and v < m["ge"]:
        return False
    if isinstance(m["le"], int) and v > m["le"]:
        return False
    return (m["gt"] is None or v > m["gt"]) and not (m["even"] and v % 2)


def check_fields(config: Mapping, source: str | Path) -> None:
    """BundleError naming `source`, the field and what was expected for the first field of
    DSV4Config that is missing, of the wrong type or out of range (see DSV4Config)."""

    def bad(name: str, what: str) -> BundleError:
        found = f"= {config[name]!r}" if name in config else "missing"
        return BundleError(f"{source}: {name} {found}, expected {what}")

    # Own type and range first, so that a bound naming another field compares two valid values.
    for f in FIELDS:
        if f.name not in config:
            if f.default is MISSING:
                raise bad(f.name, expected(f))
            continue
        v = config[f.name]
        if not (_type_ok(TYPES[f.name], v) and _own_range_ok(f, v)):
            raise bad(f.name, expected(f))
        if f.metadata["check"] and (what := f.metadata["check"](f.name, v)):
            raise bad(f.name, what)
    values = {f.name: config.get(f.name, f.default) for f in FIELDS}
    for f in FIELDS:
        v, m = values[f.name], f.metadata
        if isinstance(m["le"], str) and v > values[m["le"]]:
            raise bad(f.name, f"at most {m['le']} {values[m['le']]}")
        if m["min_len"] and len(v) < values[m["min_len"]]:
            raise bad(f.name, f"{expected(f)} ({m['min_len']} = {values[m['min_len']]})")
    for name, holds, what in _RELATIONS:
        if not holds(values):
            raise bad(name, what)


# Rules between fields that are not a bound (each names the field it reports).
_RELATIONS: tuple[tuple[str, Callable[[dict], bool], str], ...] = (
    (
        "o_groups",
        lambda c: (c["num_attention_heads"] * c["head_dim"]) % c["o_groups"] == 0,
        "a divisor of num_attention_heads * head_dim",
    ),
    (
        "index_head_dim",
        lambda c: (
            4 not in c["compress_ratios"][: c["num_hidden_layers"]]
            or c["index_head_dim"] >= c["qk_rope_head_dim"]
        ),
        "at least qk_rope_head_dim (the indexer's RoPE, on ratio-4 layers)",
    ),
)


def check_config(config: dict, f: Path) -> DSV4Config:
    """The model's fields (DSV4Config) and the keys only the bundle reads (quantization, bit
    plan, seed, stop ids), each refused in one BundleError naming `f` and the key."""
    fields = DSV4Config.from_dict(config, f)
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
        raise BundleError(f"{f}: mxtq_seed = {config['mxtq_seed']!r}, expected an integer >= 0")
    eos = config.get("eos_token_id")
    if not (eos is None or is_int(eos) or isinstance(eos, list) and all(map(is_int, eos))):
        raise BundleError(f"{f}: eos_token_id = {eos!r}, expected an integer, a list or null")
    return fields


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
