"""The manifest and config.json of a package: their values, types and ranges, checked before
any tensor is read (`reader.read` calls these first), and the config derived from the manifest."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from .files import read_json
from .layout import (
    ARCHS,
    DEFAULT_EPS,
    FORMAT,
    NORMS_KEYS,
    PackageError,
)
from .numerics import KV_GROUPS, SEED_GROUP_SIZE, WEIGHT_GROUPS

# head_dim when there is no config.json: the original definition's (= its o_proj A8 group).
DERIVED_HEAD_DIM = 128


def weight_group(manifest: dict) -> int:
    """Columns per weight scale (§2.1): the manifest's `group_size`, SEED_GROUP_SIZE when absent."""
    return manifest.get("group_size", SEED_GROUP_SIZE)


def derive_config(manifest: dict, where: str) -> dict:
    """Model dims from the manifest's `layers` shapes (head_dim = DERIVED_HEAD_DIM)."""
    layers = manifest["layers"]
    arch = manifest.get("arch")
    if arch not in ARCHS:
        raise PackageError(f"{where}: unknown arch {arch!r}, expected one of {ARCHS}")

    def shape(name: str) -> list[int]:
        if name not in layers:
            raise PackageError(f"{where}: layers has no entry {name}")
        return layers[name]["shape"]

    n_layers = 1 + max(
        (int(m.group(1)) for k in layers if (m := re.match(r"model\.layers\.(\d+)\.", k))),
        default=-1,
    )
    head_dim = DERIVED_HEAD_DIM
    q, k = shape("model.layers.0.self_attn.q_proj"), shape("model.layers.0.self_attn.k_proj")
    rope = manifest.get("rope") or {}
    return {
        "model_type": "bitnest",
        "arch": arch,
        "hidden_size": q[1],
        "num_hidden_layers": n_layers,
        "intermediate_size": shape("model.layers.0.mlp.gate_proj")[0],
        "num_attention_heads": q[0] // head_dim,
        "num_key_value_heads": k[0] // head_dim,
        "head_dim": head_dim,
        "vocab_size": shape("lm_head")[0],
        "rms_norm_eps": DEFAULT_EPS[arch],
        "rope_theta": rope.get("theta", 10000.0),
        "rope_scaling": rope.get("scaling"),
        "max_position_embeddings": rope.get("max_position_embeddings", 4096),
        "tie_word_embeddings": False,
    }


_CONFIG_DIMS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def check_manifest(manifest: dict, f: Path) -> None:
    """Manifest-only rules: format, arch, group size and the well-formedness of `layers`."""
    if manifest.get("format") != FORMAT:
        raise PackageError(f"{f}: format is {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("arch") not in ARCHS:
        raise PackageError(f"{f}: unknown arch {manifest.get('arch')!r}, expected one of {ARCHS}")
    group = weight_group(manifest)
    if not (isinstance(group, int) and group in WEIGHT_GROUPS):
        raise PackageError(f"{f}: group_size = {group!r}, expected one of {WEIGHT_GROUPS}")
    layers = manifest.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise PackageError(f"{f}: expected a non-empty 'layers' object (Linear name -> shape)")
    for name, entry in layers.items():
        _check_layer(name, entry, group, f)
    for block in ("kv", "online_hadamard", "activation", "rope", "norms"):
        if block in manifest and not isinstance(manifest[block], dict):
            raise PackageError(f"{f}: {block} is {manifest[block]!r}, expected an object")
    groups = manifest.get("activation", {}).get("per_layer_group", {})
    if not isinstance(groups, dict):
        raise PackageError(
            f"{f}: activation.per_layer_group is {groups!r}, expected an object (Linear -> group)"
        )
    # `norms` is interpreted since the smoothing extension (§2.5): a key this reader does not know
    # might change the function, so it is refused rather than ignored.
    for key, value in manifest.get("norms", {}).items():
        if key not in NORMS_KEYS:
            raise PackageError(
                f"{f}: norms.{key}: unknown key; expected only {', '.join(NORMS_KEYS)} (this "
                "reader cannot interpret it)"
            )
        if key == "smoothing" and not isinstance(value, bool):
            raise PackageError(f"{f}: norms.smoothing = {value!r}, expected true or false")
    _check_kv(manifest.get("kv", {}), layers, f)


def _check_layer(name: str, entry, group: int, f: Path) -> None:
    """One `layers` entry: [N, K] with K a multiple of the group, its groups and has_bias."""
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (
        isinstance(shape, list)
        and len(shape) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape)
    ):
        raise PackageError(
            f"{f}: {name}: shape is {shape!r}, expected [N, K] (two positive integers)"
        )
    k = shape[1]
    if k % group:
        raise PackageError(
            f"{f}: {name}: K = {k}, expected a multiple of {group} "
            f"(group_size: one scale per {group} columns)"
        )
    if entry.get("groups", k // group) != k // group:
        raise PackageError(
            f"{f}: {name}: groups = {entry['groups']!r}, expected K/{group} = {k // group} "
            f"(group_size {group})"
        )
    if not isinstance(entry.get("has_bias", False), bool):
        raise PackageError(f"{f}: {name}: has_bias = {entry['has_bias']!r}, expected a bool")


def _check_kv(kv: dict, layers: dict, f: Path) -> None:
    """The `kv` block: its offset, R3 flags and group, and a k_bias offset's biases."""
    if kv.get("per_channel_offset", "none") not in ("none", "k_bias"):
        raise PackageError(
            f"{f}: kv.per_channel_offset = {kv['per_channel_offset']!r}, expected 'k_bias' or "
            "'none'"
        )
    for key in ("r3", "r3_enabled"):
        if not isinstance(kv.get(key, False), bool):
            raise PackageError(f"{f}: kv.{key} = {kv[key]!r}, expected true or false")
    kv_group = kv.get("group")
    if kv_group is not None and kv_group not in KV_GROUPS:
        raise PackageError(
            f"{f}: kv.group = {kv_group!r}, expected one of {KV_GROUPS} (MLX's group sizes)"
        )
    if kv.get("per_channel_offset") == "k_bias":
        unbiased = [n for n, e in layers.items() if n.endswith("k_proj") and not e.get("has_bias")]
        if unbiased:
            raise PackageError(
                f"{f}: kv.per_channel_offset is 'k_bias' but {unbiased[0]} has no bias"
            )


def load_config(path: Path, manifest: dict, manifest_file: Path) -> dict:
    derived = derive_config(manifest, str(manifest_file))
    f = path / "config.json"
    if not f.is_file():
        warnings.warn(
            f"{path}: no config.json; dims derived from the manifest, "
            f"rms_norm_eps = {derived['rms_norm_eps']} ({derived['arch']} default)",
            stacklevel=3,
        )
        return derived
    config = read_json(f)
    if config.get("model_type") != "bitnest":
        raise PackageError(f'{f}: model_type is {config.get("model_type")!r}, expected "bitnest"')
    for key in ("quantization", "quantization_config"):
        if key in config:
            # mlx-lm would re-quantize the model from this key; the planes are the quantization.
            raise PackageError(f"{f}: has a {key!r} key; expected none in a bitnest config")
    if config.get("arch", derived["arch"]) != derived["arch"]:
        raise PackageError(
            f"{f}: arch {config['arch']!r} disagrees with the manifest's {derived['arch']!r}"
        )
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim")
    if head_dim is None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        head_dim = hidden // heads
    if not _positive(head_dim, int):
        raise PackageError(f"{f}: expected head_dim, or hidden_size and num_attention_heads")
    config["head_dim"] = head_dim  # null, like a missing key, means hidden_size / heads
    if config.get("num_key_value_heads") is None:  # HF default: no grouped-query attention
        config["num_key_value_heads"] = heads
    # Head counts follow from the q/k output widths once head_dim is known.
    layers = manifest["layers"]
    q_out = layers["model.layers.0.self_attn.q_proj"]["shape"][0]
    kv_out = layers["model.layers.0.self_attn.k_proj"]["shape"][0]
    derived.update(
        head_dim=head_dim,
        num_attention_heads=q_out // head_dim,
        num_key_value_heads=kv_out // head_dim,
    )
    for key in _CONFIG_DIMS:
        if config.get(key) != derived[key]:
            raise PackageError(
                f"{f}: {key} = {config.get(key)} but the layer shapes in {manifest_file.name} "
                f"imply {derived[key]}"
            )
    _check_config_values(config, manifest, f, manifest_file)
    return {**derived, **config, "arch": derived["arch"]}


def _positive(value, kind: type) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool) and value > 0


def _check_config_values(config: dict, manifest: dict, f: Path, manifest_file: Path) -> None:
    """The non-dimension values the forward uses have their types, and agree with the manifest's
    copy where it has one (config.json and bitnest.json both carry the RoPE parameters)."""
    for key, kind in (
        ("rms_norm_eps", (int, float)),
        ("rope_theta", (int, float)),
        ("max_position_embeddings", int),
    ):
        if key in config and not _positive(config[key], kind):
            raise PackageError(f"{f}: {key} = {config[key]!r}, expected a positive number")
    scaling = config.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise PackageError(f"{f}: rope_scaling = {scaling!r}, expected an object or null")
    rope = manifest.get("rope", {})
    for ours, theirs in (("rope_theta", "theta"), ("rope_scaling", "scaling")):
        if ours in config and theirs in rope and config[ours] != rope[theirs]:
            raise PackageError(
                f"{f}: {ours} = {config[ours]!r} but {manifest_file.name} rope.{theirs} = "
                f"{rope[theirs]!r}; expected the two to agree"
            )


def check_o_proj_group(manifest: dict, config: dict, f: Path) -> None:
    """The o_proj A8 group (the one entry of per_layer_group the forward reads, §3.2): -1 (per
    token) or a positive divisor of the o_proj input width."""
    key = "model.layers.0.self_attn.o_proj"
    group = manifest.get("activation", {}).get("per_layer_group", {}).get(key)
    width = config["num_attention_heads"] * config["head_dim"]
    valid = group == -1 or _positive(group, int) and width % group == 0
    if group is not None and not (valid and isinstance(group, int)):
        raise PackageError(
            f"{f}: activation.per_layer_group {key} = {group!r}, expected -1 or a positive "
            f"divisor of the o_proj input width {width}"
        )
