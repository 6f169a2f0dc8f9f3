"""Writing DeepSeek-V4 bundles in jang's MLX layout (read them with formats/dsv4_bundle.py).

For tests, demos and converters: the output is what jang's rebundler produces (dtypes, key
order, shards, bit plan in config.json), so `dsv4_bundle.read` and the model see the same bytes a
real bundle would give them. The schedule and stored key names come from dsv4_bundle.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import checksums, mxtq, safetensors_io
from .dsv4_bundle import CHECKSUMS_KEY, INDEX_FILE, plan_key, schedule, stored_expert_name
from .dsv4_config import BundleError

# Passthrough tensors jang keeps in float32 (the rest of the passthrough class goes to float16).
_F32_PASSTHROUGH = re.compile(r"(hc_|attn_sink|\.ape$|gate\.bias$)")


def write(
    path: str | Path,
    config: dict,
    weights: dict[str, np.ndarray],
    *,
    expert_bits: dict[str, int] | None = None,
    quantize: bool = True,
    per_expert: bool = False,
    shards: int = 2,
) -> Path:
    """Write float weights (model parameter names) as a bundle in jang's layout.

    quantize: linears as MLX affine 8-bit group 32, routed experts as MXTQ with
    `expert_bits["layer_L.<proj>"]` bits (default 4); the plan is recorded in config.json.
    Otherwise everything is float32 under the official names. per_expert: routed experts under
    `layers.L.ffn.experts.E.w{1,2,3}` instead of pre-stacked `layers.L.mlp.switch_mlp.*`.
    Deterministic for deterministic input.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    slots = schedule(config)
    seed = int(config.get("mxtq_seed", mxtq.DEFAULT_SEED))
    expert_bits = expert_bits or {}
    config = dict(config, model_type="deepseek_v4")
    out: dict[str, np.ndarray] = {}
    plan = {}
    for name, slot in slots.items():
        w = weights[name if slot.kind in ("float", "int") else f"{name}.weight"]
        if slot.kind == "int":
            out[name] = np.asarray(w, dtype=np.int32)
        elif slot.kind == "float":
            f32 = not quantize or _F32_PASSTHROUGH.search(name)
            out[name] = np.asarray(w, dtype=np.float32 if f32 else np.float16)
        elif slot.kind == "experts":
            bits = None
            if quantize:
                plan[plan_key(name)] = bits = expert_bits.get(plan_key(name), 4)
            out.update(_experts(name, w, bits, seed, per_expert, slot.shape[0]))
        elif quantize:
            wq, scales, biases = mx.quantize(mx.array(w, dtype=mx.float32), group_size=32, bits=8)
            out[f"{name}.weight"] = np.array(wq)
            out[f"{name}.scales"] = np.array(scales.astype(mx.float16))
            out[f"{name}.biases"] = np.array(biases.astype(mx.float16))
        else:
            out[f"{name}.weight"] = np.asarray(w, dtype=np.float32)

    if quantize:
        config |= _quantization_notes(seed, plan)
    files = _write_shards(path, out, shards)
    # config.json last: it records the checksums of the shards and of itself (a caller adding
    # files afterwards, a tokenizer, calls `seal` to record them too).
    checksums.make_block(config, CHECKSUMS_KEY, files, {}, path / "config.json")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _quantization_notes(seed: int, plan: dict[str, int]) -> dict:
    """config.json's record of the quantization: affine 8-bit Linears, MXTQ experts by plan."""
    return {
        "quantization": {"bits": 8, "group_size": 32, "mode": "affine"},
        "weight_format": "mxtq",
        "mxtq_seed": seed,
        "routed_expert_bit_plan": {
            "codec": "mxtq",
            "bits_used": sorted(set(plan.values())),
            "assignment": plan,
        },
    }


def _experts(
    name: str, w: np.ndarray, bits: int | None, seed: int, per_expert: bool, n_experts: int
) -> dict[str, np.ndarray]:
    """One layer projection's routed experts: MXTQ at `bits` (None: float32), stacked or,
    with `per_expert`, one tensor set per expert."""
    if bits is not None:
        q = mxtq.encode(np.asarray(w, np.float32), bits, seed)
        stacked = q.tensors(stored_expert_name(name))
        # jang's prestack rewrites tq_bits as uint8.
        stacked = {
            k: v.astype(np.uint8) if k.endswith("tq_bits") else v for k, v in stacked.items()
        }
    else:
        stacked = {f"{stored_expert_name(name)}.weight": np.float32(w)}
    if not per_expert:
        return stacked
    out = {}
    for key, v in stacked.items():
        leaf = key.rsplit(".", 1)[1]
        for e in range(n_experts):
            out[f"{stored_expert_name(name, e)}.{leaf}"] = v if leaf == "tq_bits" else v[e]
    return out


def _write_shards(path: Path, tensors: dict[str, np.ndarray], shards: int) -> list[Path]:
    """The safetensors files (and index) of `tensors`; returns the files."""
    # jang's rebundler writes the stacked expert groups first; keep that order.
    keys = sorted(tensors, key=lambda k: (".switch_mlp." not in k, k))
    shards = max(1, min(shards, len(keys)))
    if shards == 1:
        mx.save_safetensors(
            str(path / "model.safetensors"),
            {k: mx.array(tensors[k]) for k in keys},
            metadata={"format": "mlx"},
        )
        return [path / "model.safetensors"]
    weight_map, total, files = {}, 0, []
    for i, chunk in enumerate(np.array_split(np.array(keys, dtype=object), shards)):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        arrays = {k: mx.array(tensors[k]) for k in chunk}
        mx.save_safetensors(str(path / fname), arrays, metadata={"format": "mlx"})
        files.append(path / fname)
        weight_map.update({k: fname for k in chunk})
        total += sum(a.nbytes for a in arrays.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def seal(path: str | Path) -> Path:
    """Recompute a bundle's checksums after a deliberate edit of its config or tensors (the
    files named by the index, else every *.safetensors); checks nothing else."""
    path = Path(path)
    config = safetensors_io.read_json(path / "config.json", BundleError)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = safetensors_io.read_json(index, BundleError)["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    checksums.make_block(config, CHECKSUMS_KEY, files, {}, path / "config.json")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


__all__ = ["seal", "write"]
