"""DeepSeek-V4 bundles in jang's MLX layout: the key schedule and strict reading.

A bundle is a directory with config.json (model_type `deepseek_v4`) and safetensors, one file or
shards listed in `model.safetensors.index.json`. Keys are the official checkpoint names
(spec: docs/deepseek-v4-spec.md §10-§12):

* Linears (`embed`, `head`, attention, shared experts, compressors, indexers): MLX affine
  (`.weight` uint32 + `.scales`/`.biases`, 8 bits group 32 unless config.json says otherwise for
  that module) or a plain float `.weight`.
* Routed experts: MXTQ triples `tq_packed/tq_norms/tq_bits`, stacked under
  `layers.L.mlp.switch_mlp.{gate,up,down}_proj` or per expert under
  `layers.L.ffn.experts.E.w{1,3,2}`; or float, stacked `[E, out, in]` or per expert.
* Passthrough floats: norms, router weight and bias, `ape`, `attn_sink`, `hc_*`. `tid2eid` integer.
* `mtp.*` (the multi-token-prediction layer) is ignored: this runtime does not build it.

Reading is strict: an unexpected, missing, misshapen or mistyped tensor, a routed bit plan that
disagrees with a tensor's `tq_bits`, or an MXTQ row length that does not fill whole words is a
`BundleError` naming the key. The result is keyed by model parameter names
(`models/deepseek_v4.py`): the official names with routed experts at
`layers.L.ffn.switch_mlp.<proj>`.

Writing is formats/dsv4_bundle_write.py; both sides take the schedule and the stored key names
from formats/dsv4_schedule.py, so a layout rule lives in one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from . import checksums, mxtq, safetensors_io
from .dsv4_config import BundleError, check_config, is_int
from .dsv4_schedule import (  # the layout, re-exported: callers know it as dsv4_bundle's
    FLOATS,
    INTS,
    PROJECTIONS,
    Slot,
    check_float_families,
    plan_key,
    schedule,
    stored_expert_name,
)
from .dsv4_schedule import layer_proj as layer_proj

INDEX_FILE = "model.safetensors.index.json"
# The optional integrity block in config.json (formats/checksums.py); jang ignores the key.
CHECKSUMS_KEY = "bitnest_checksums"


@dataclass
class Bundle:
    config: dict
    tensors: dict[str, mx.array]  # model parameter name -> array as stored (dtype not changed)
    formats: dict[str, str | int]  # slot name -> "float" | "affine" | MXTQ bits (int)
    affine: dict[str, tuple[int, int]]  # slot name -> (bits, group_size) for affine slots
    seed: int
    path: Path
    ignored: list[str] = field(default_factory=list)


def is_bundle(path: str | Path) -> bool:
    """config.json says model_type deepseek_v4 (cheap: mlx-lm's loader asks about every model)."""
    try:  # a broken config.json is named by whichever reader then opens it
        config = safetensors_io.read_json(Path(path) / "config.json", ValueError)
    except ValueError:
        return False
    return config.get("model_type") == "deepseek_v4"


# ---------------------------------------------------------------- reading


_STACKED = re.compile(r"^layers\.(\d+)\.mlp\.switch_mlp\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_PER_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.(\w+)$")
_W_TO_PROJ = {w: p for p, w in PROJECTIONS.items()}


def resolve_seed(path: Path, config: dict) -> int:
    """`mxtq_seed` from config.json, else jang_config.json, else 42; two different values fail."""
    found = {"config.json": config.get("mxtq_seed")}
    jang = path / "jang_config.json"
    if jang.is_file():
        found["jang_config.json"] = safetensors_io.read_json(jang, BundleError).get("mxtq_seed")
    for fname, v in found.items():
        if v is not None and not (is_int(v) and v >= 0):
            raise BundleError(f"{path / fname}: mxtq_seed = {v!r}, expected an integer >= 0")
    values = {k: v for k, v in found.items() if v is not None}
    if len(set(values.values())) > 1:
        raise BundleError(f"mxtq_seed disagrees between files: {values}")
    return next(iter(values.values()), mxtq.DEFAULT_SEED)


def _load_tensors(path: Path) -> dict[str, tuple[Path, mx.array]]:
    """Every stored tensor with the file holding it."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = safetensors_io.string_map(
            safetensors_io.read_json(index, BundleError).get("weight_map"),
            index,
            "weight_map",
            BundleError,
        )
        by_file: dict[str, set[str]] = {}
        for key, fname in weight_map.items():
            by_file.setdefault(fname, set()).add(key)
        for fname, keys in sorted(by_file.items()):
            if not (path / fname).is_file():
                raise BundleError(f"{INDEX_FILE} lists {fname} (e.g. {min(keys)}), not found")
        tensors = {}
        for fname, keys in sorted(by_file.items()):
            shard = safetensors_io.load_safetensors(path / fname, BundleError)
            missing, extra = keys - shard.keys(), shard.keys() - keys
            if missing:
                raise BundleError(f"{min(missing)}: in {INDEX_FILE} but not in {fname}")
            if extra:
                raise BundleError(f"{min(extra)}: in {fname} but not in {INDEX_FILE}")
            tensors.update({k: (path / fname, a) for k, a in shard.items()})
        return tensors
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BundleError(f"{path}: no safetensors files")
    tensors = {}
    for f in files:
        for key, value in safetensors_io.load_safetensors(f, BundleError).items():
            if key in tensors:
                raise BundleError(f"{key}: stored twice ({f.name})")
            tensors[key] = (f, value)
    return tensors


def _require(key: str, a: mx.array, shape: tuple, dtypes: tuple) -> None:
    if a.dtype not in dtypes:
        raise BundleError(f"{key}: dtype {a.dtype}, expected one of {[str(t) for t in dtypes]}")
    if tuple(a.shape) != tuple(shape):
        raise BundleError(f"{key}: shape {tuple(a.shape)}, expected {tuple(shape)}")


def affine_params(config: dict, name: str) -> tuple[int, int]:
    """(bits, group) of the affine tensor `name`: its own `quantization` entry, else the
    bundle's defaults (8 bits, groups of 32)."""
    q = config.get("quantization") or {}
    own = q.get(name) if isinstance(q.get(name), dict) else {}
    return int(own.get("bits", q.get("bits", 8))), int(
        own.get("group_size", q.get("group_size", 32))
    )


def bit_plan(config: dict) -> dict[str, int]:
    """`routed_expert_bit_plan.assignment` ("layer_L.<proj>": bits), top level or `quantization`."""
    plan = {}
    for holder in (config, config.get("quantization") or {}):
        for key, bits in (
            (holder.get("routed_expert_bit_plan") or {}).get("assignment") or {}
        ).items():
            if plan.get(key, bits) != bits:
                raise BundleError(f"routed_expert_bit_plan: {key} is {plan[key]} and {bits}")
            plan[key] = int(bits)
    return plan


def read(path: str | Path, verify: bool = False) -> Bundle:
    """Read and validate a bundle against its config's schedule (see the module docstring);
    `verify` also hashes the data against config.json's checksums (formats/checksums.py)."""
    path = Path(path)
    config_file = path / "config.json"
    config = safetensors_io.read_json(config_file, BundleError)
    if config.get("model_type") != "deepseek_v4":
        found = f"= {config['model_type']!r}" if "model_type" in config else "missing"
        raise BundleError(f"{config_file}: model_type {found}, expected 'deepseek_v4'")
    slots = schedule(check_config(config, config_file))
    seed = resolve_seed(path, config)
    stored = _load_tensors(path)

    # Group stored keys by slot; anything the schedule does not know is an error. Each part
    # carries "<file>: <key>", the name its errors give.
    parts: dict[str, dict[str, tuple[str, mx.array]]] = {}
    ignored = []
    for key, (f, a) in stored.items():
        if key.startswith("mtp."):
            ignored.append(key)
            continue
        slot, part = _slot_of(key, slots)
        if slot is None:
            raise BundleError(f"{f}: {key}: not expected by the config's layer schedule")
        parts.setdefault(slot, {})[part] = (f"{f}: {key}", a)

    out: dict[str, mx.array] = {}
    formats: dict[str, str | int] = {}
    affine: dict[str, tuple[int, int]] = {}
    plan = bit_plan(config)
    for name, slot in slots.items():
        got = parts.get(name, {})
        if slot.kind in ("float", "int"):
            if "" not in got:
                raise BundleError(f"{name}: missing")
            key, a = got[""]
            _require(key, a, slot.shape, FLOATS if slot.kind == "float" else INTS)
            if slot.kind == "int":
                _check_expert_ids(key, a, config["n_routed_experts"])
            out[name] = a
        elif slot.kind in ("linear", "embedding"):
            formats[name] = _read_linear(name, slot, got, config, out, affine)
        else:
            formats[name] = _read_experts(name, slot, got, out)
            _check_plan(name, formats[name], plan)
    check_float_families(out)
    # Last, so that a broken file is refused with the rule it breaks (formats/checksums.py).
    tensor_files = {key: f for key, (f, _) in stored.items()}
    checksums.verify(config, config_file, CHECKSUMS_KEY, tensor_files, {}, BundleError, data=verify)
    return Bundle(config, out, formats, affine, seed, path, sorted(ignored))


def _check_expert_ids(key: str, a: mx.array, n_experts: int) -> None:
    """tid2eid indexes the expert weights: an id out of range would read outside them."""
    if a.size and not (mx.min(a).item() >= 0 and mx.max(a).item() < n_experts):
        raise BundleError(f"{key}: expert ids outside [0, {n_experts}) (n_routed_experts)")


def _slot_of(key: str, slots: dict[str, Slot]) -> tuple[str | None, str]:
    """(slot name, part) for a stored key; part "" is the whole tensor of a float/int slot."""
    if key in slots:
        return key, ""
    m = _STACKED.match(key)
    if m:
        return f"layers.{m[1]}.ffn.switch_mlp.{m[2]}", f"stacked.{m[3]}"
    m = _PER_EXPERT.match(key)
    if m:
        return f"layers.{m[1]}.ffn.switch_mlp.{_W_TO_PROJ[m[3]]}", f"expert.{m[2]}.{m[4]}"
    base, _, leaf = key.rpartition(".")
    if base in slots and leaf in ("weight", "scales", "biases"):
        return base, leaf
    return None, ""


def _take_float(name: str, slot, got: dict, out: dict) -> bool:
    """A lone float `weight` is an unquantized Linear: check it and store it."""
    if set(got) != {"weight"}:
        return False
    key, a = got["weight"]
    _require(key, a, slot.shape, FLOATS)
    out[f"{name}.weight"] = a
    return True


def _require_parts(name: str, got: dict, parts: tuple[str, ...]) -> None:
    for part in parts:
        if part not in got:
            raise BundleError(f"{name}.{part}: missing")


def _read_linear(name, slot, got, config, out, affine) -> str:
    out_f, in_f = slot.shape
    if _take_float(name, slot, got, out):
        return "float"
    _require_parts(name, got, ("weight", "scales", "biases"))
    bits, group = affine_params(config, name)
    if in_f % group:
        raise BundleError(f"{name}.scales: in_features {in_f} not divisible by group {group}")
    key, w = got["weight"]
    _require(key, w, (out_f, in_f * bits // 32), (mx.uint32,))
    for part in ("scales", "biases"):
        key, a = got[part]
        _require(key, a, (out_f, in_f // group), FLOATS)
        out[f"{name}.{part}"] = a
    out[f"{name}.weight"] = w
    affine[name] = (bits, group)
    return "affine"


def _read_experts(name, slot, got, out) -> str | int:
    n_exp, out_f, in_f = slot.shape
    kinds = {p.split(".")[0] for p in got}
    if not got:
        raise BundleError(f"{name}: missing (stacked .tq_packed/.weight or per-expert keys)")
    if len(kinds) > 1:
        raise BundleError(f"{name}: both stacked and per-expert keys are stored")
    if kinds == {"stacked"}:
        fields = {p.split(".", 1)[1]: ka for p, ka in got.items()}
    else:  # per expert: every expert needs the same fields; stack them
        by_expert: dict[int, dict[str, tuple[str, mx.array]]] = {}
        for p, ka in got.items():
            _, e, leaf = p.split(".")
            if int(e) >= n_exp:
                raise BundleError(f"{ka[0]}: expert {e} >= n_routed_experts {n_exp}")
            by_expert.setdefault(int(e), {})[leaf] = ka
        leaves = set(by_expert.get(0, {}))
        for e in range(n_exp):
            if set(by_expert.get(e, {})) != leaves:
                miss = sorted(leaves - set(by_expert.get(e, {}))) or ["?"]
                raise BundleError(f"{stored_expert_name(name, e)}.{miss[0]}: missing")
        fields = {}
        for leaf in leaves:
            keys = [by_expert[e][leaf][0] for e in range(n_exp)]
            arrays = [by_expert[e][leaf][1] for e in range(n_exp)]
            if leaf == "tq_bits":
                values = {int(a.reshape(-1)[0].item()) for a in arrays}
                if len(values) > 1:
                    raise BundleError(f"{keys[0]}: experts of one projection differ in bits")
                fields[leaf] = (keys[0], arrays[0])
                continue
            for k, a in zip(keys, arrays):
                if a.shape != arrays[0].shape or a.dtype != arrays[0].dtype:
                    raise BundleError(f"{k}: shape/dtype differs from expert 0")
            fields[leaf] = (f"{keys[0]} (stacked)", mx.stack(arrays))

    if _take_float(name, slot, fields, out):
        return "float"
    _require_parts(name, fields, ("tq_packed", "tq_norms", "tq_bits"))
    extra = set(fields) - {"tq_packed", "tq_norms", "tq_bits"}
    if extra:
        raise BundleError(f"{name}.{min(extra)}: unexpected next to MXTQ tensors")
    key, b = fields["tq_bits"]
    _require(key, b, (1,), INTS)
    bits = int(b.item())
    if bits not in mxtq.SUPPORTED_BITS:
        raise BundleError(f"{key}: {bits} bits, supported {mxtq.SUPPORTED_BITS}")
    try:
        mxtq.check_in_features(in_f, bits)
    except ValueError as e:
        raise BundleError(f"{fields['tq_packed'][0]}: {e}") from None
    key, packed = fields["tq_packed"]
    _require(key, packed, (n_exp, out_f, in_f // mxtq.values_per_word(bits)), (mx.uint32,))
    key, norms = fields["tq_norms"]
    _require(key, norms, (n_exp, out_f), (mx.float16,))
    out[f"{name}.tq_packed"], out[f"{name}.tq_norms"] = packed, norms
    out[f"{name}.tq_bits"] = mx.array([bits], dtype=mx.int32)
    return bits


def _check_plan(name: str, fmt: str | int, plan: dict[str, int]) -> None:
    want = plan.get(plan_key(name))
    if want is None:
        return
    if fmt == "float":
        raise BundleError(f"{name}: the bit plan says {want} bits but the experts are float")
    if want != fmt:
        raise BundleError(
            f"{stored_expert_name(name)}.tq_bits is {fmt}, but "
            f"routed_expert_bit_plan assigns {plan_key(name)} = {want}"
        )
