"""bitnest-package-v1: read, validate and write packages (spec: shared/specs/bitnest-package-v1.md).

Pure I/O: knows the files, tensor names and integer maps, and nothing about the model forward.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .hadamard import hadamard_k, is_power_of_two, r4_transform, split_k

FORMAT = "bitnest-package-v1"
MANIFEST_NAMES = ("bitnest.json", "manifest.json")
GROUP_SIZE = 128
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
_DEFAULT_EPS = {"llama": 1e-5, "qwen2": 1e-6}
_NORM_RE = re.compile(r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight")
_ACT_ORDER_RE = re.compile(r"(g_idx|perm|act_order)")


class PackageError(ValueError):
    """A package that breaks bitnest-package-v1; the message names file, tensor, expectation."""


@dataclass
class Package:
    path: Path
    manifest: dict
    config: dict
    tensors: dict[str, mx.array]

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]


# ---------------------------------------------------------------------------------------------
# Integer maps (exact; shared by the writer, the validator and the tests)


def pack_nibbles(u: np.ndarray) -> np.ndarray:
    """uint8 codes in [0, 15], [N, K] -> [N, K/2]; byte j = column 2j (low) | column 2j+1 (high)."""
    u = u.astype(np.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_nibbles(b: np.ndarray) -> np.ndarray:
    """Inverse of pack_nibbles: uint8 [N, K/2] -> uint8 codes [N, K]."""
    out = np.empty((*b.shape[:-1], b.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2], out[..., 1::2] = b & 0xF, b >> 4
    return out


@dataclass
class Planes:
    hi: np.ndarray  # uint8 [N, K/2]
    lo: np.ndarray  # uint8 [N, K/2]
    scales: np.ndarray  # float16 [N, K/128]
    saturation: float  # fraction of residuals clipped at +-8
    w8_max_rel_err: float  # max|W8 - W| / max|W|
    w4_rel_fro_err: float  # ||W4 - W||_F / ||W||_F


def quantize_planes(w: np.ndarray) -> Planes:
    """RTN planes: q4 = round(w/s), s = amax/7 per 128 columns; qr = round((w - q4 s)/(s/16))."""
    n, k = w.shape
    wg = w.astype(np.float32).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    amax = np.abs(wg).max(-1)
    # Codes are computed from the fp16 scale actually stored, so dequantization is consistent.
    s16 = np.maximum(amax / 7, 2.0**-14).astype(np.float16)
    s16[amax == 0] = 1
    s = s16.astype(np.float32)[..., None]
    q4 = np.clip(np.round(wg / s), -8, 7)
    raw = np.round((wg - q4 * s) / (s / 16))
    qr = np.clip(raw, -8, 7)
    qr = np.where(q4 == -8, np.maximum(qr, 0), qr)  # q8 = 16*q4 + qr must stay >= -128
    w4, w8 = q4 * s, (16 * q4 + qr) * s / 16
    wmax = max(float(np.abs(wg).max()), 1e-30)
    return Planes(
        hi=pack_nibbles((q4 + 8).reshape(n, k)),
        lo=pack_nibbles((qr + 8).reshape(n, k)),
        scales=s16,
        saturation=float(np.mean(raw != qr)),
        w8_max_rel_err=float(np.abs(w8 - wg).max() / wmax),
        w4_rel_fro_err=float(np.linalg.norm(w4 - wg) / max(np.linalg.norm(wg), 1e-30)),
    )


def dequantize_planes(
    hi: np.ndarray, lo: np.ndarray, scales: np.ndarray, draft: bool
) -> np.ndarray:
    """W4 = q4 s (draft) or W8 = (16 q4 + qr) s / 16 (target), float64 [N, K]."""
    q4 = unpack_nibbles(np.asarray(hi)).astype(np.float64) - 8
    s = np.repeat(np.asarray(scales, dtype=np.float64), GROUP_SIZE, axis=-1)
    if draft:
        return q4 * s
    qr = unpack_nibbles(np.asarray(lo)).astype(np.float64) - 8
    return (16 * q4 + qr) * s / 16


# ---------------------------------------------------------------------------------------------
# Reading


def find_manifest(path: Path) -> Path:
    if not path.is_dir():
        raise PackageError(f"{path}: not a directory (a bitnest package is a directory)")
    found = []
    for name in MANIFEST_NAMES:
        f = path / name
        if not f.is_file():
            continue
        if name == "manifest.json" and _read_json(f).get("format") != FORMAT:
            continue
        found.append(f)
    if not found:
        raise PackageError(
            f"{path}: no manifest: expected bitnest.json (or manifest.json with "
            f'"format": "{FORMAT}")'
        )
    if len(found) > 1:
        raise PackageError(
            f"{path}: two manifests ({', '.join(f.name for f in found)}); keep exactly one"
        )
    return found[0]


def is_package(path: str | Path) -> bool:
    try:
        find_manifest(Path(path))
    except PackageError:
        return False
    return True


def _read_json(f: Path) -> dict:
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackageError(f"{f}: unreadable JSON ({e})") from e


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise PackageError(f"{index}: expected a 'weight_map' object")
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise PackageError(f"{index}: lists {f.name}, which does not exist")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    if shards:
        raise PackageError(f"{path}: sharded safetensors without model.safetensors.index.json")
    raise PackageError(f"{path}: no model.safetensors (or shards with an index)")


def _check_safetensors(f: Path) -> None:
    """Header sanity and size, so a truncated file is named instead of failing deep in a load."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise PackageError(f"{f}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise PackageError(
                f"{f}: truncated safetensors file: header says {n} bytes, file has {size}"
            )
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PackageError(f"{f}: unreadable safetensors header ({e})") from e
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise PackageError(
            f"{f}: truncated safetensors file: tensors need {8 + n + end} bytes, file has {size}"
        )


def read_tensors(path: Path) -> dict[str, tuple[Path, mx.array]]:
    """All tensors of a package, each with the file it came from."""
    out: dict[str, tuple[Path, mx.array]] = {}
    for f in _safetensors_files(path):
        _check_safetensors(f)
        try:
            arrays = mx.load(str(f))
        except Exception as e:  # mlx raises RuntimeError/ValueError with its own wording
            raise PackageError(f"{f}: unreadable safetensors file ({e})") from e
        for name, a in arrays.items():
            if name in out:
                raise PackageError(f"{f}: tensor {name} also in {out[name][0].name}")
            out[name] = (f, a)
    return out


def derive_config(manifest: dict, where: str) -> dict:
    """Model dims from the manifest's `layers` shapes (head_dim = o_proj activation group = 128)."""
    layers = manifest["layers"]

    def shape(name: str) -> list[int]:
        if name not in layers:
            raise PackageError(f"{where}: layers has no entry {name}")
        return layers[name]["shape"]

    n_layers = 1 + max(
        (int(m.group(1)) for k in layers if (m := re.match(r"model\.layers\.(\d+)\.", k))),
        default=-1,
    )
    head_dim = GROUP_SIZE
    q, k = shape("model.layers.0.self_attn.q_proj"), shape("model.layers.0.self_attn.k_proj")
    rope = manifest.get("rope") or {}
    arch = manifest["arch"]
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
        "rms_norm_eps": _DEFAULT_EPS[arch],
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


def _load_config(path: Path, manifest: dict, manifest_file: Path) -> dict:
    derived = derive_config(manifest, str(manifest_file))
    f = path / "config.json"
    if not f.is_file():
        warnings.warn(
            f"{path}: no config.json; dims derived from the manifest, "
            f"rms_norm_eps = {derived['rms_norm_eps']} ({derived['arch']} default)",
            stacklevel=3,
        )
        return derived
    config = _read_json(f)
    if config.get("model_type") != "bitnest":
        raise PackageError(f'{f}: model_type is {config.get("model_type")!r}, expected "bitnest"')
    for key in ("quantization", "quantization_config"):
        if key in config:
            raise PackageError(f"{f}: has a {key!r} key; bitnest configs must not")
    if config.get("arch", derived["arch"]) != derived["arch"]:
        raise PackageError(
            f"{f}: arch {config['arch']!r} disagrees with the manifest's {derived['arch']!r}"
        )
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    derived["head_dim"] = head_dim
    derived["num_attention_heads"] = derived["hidden_size"] // head_dim
    derived["num_key_value_heads"] = (
        manifest["layers"]["model.layers.0.self_attn.k_proj"]["shape"][0] // head_dim
    )
    for key in _CONFIG_DIMS:
        if config.get(key) != derived[key]:
            raise PackageError(
                f"{f}: {key} = {config.get(key)} but {manifest_file.name} layer shapes imply "
                f"{derived[key]}"
            )
    return {**derived, **config, "arch": derived["arch"]}


def _fail(f: Path, name: str, msg: str) -> PackageError:
    return PackageError(f"{f.name}: tensor {name}: {msg}")


def _expect(tensors, name: str, dtype, shape: tuple[int, ...], where: Path) -> mx.array:
    if name not in tensors:
        raise PackageError(f"{where}: missing tensor {name} (expected {_dt(dtype)} {list(shape)})")
    f, a = tensors[name]
    if a.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise _fail(f, name, f"dtype {a.dtype} but expected {_dt(dtype)}")
    if tuple(a.shape) != shape:
        raise _fail(f, name, f"shape {list(a.shape)} but expected {list(shape)}")
    return a


def _dt(dtype) -> str:
    return " or ".join(str(d) for d in dtype) if isinstance(dtype, tuple) else str(dtype)


def _check_low_codes(f: Path, name: str, hi: mx.array, lo: mx.array) -> None:
    """u_lo must be >= 8 where u_hi == 0, else q8 = 16 q4 + qr < -128."""
    bad = ((hi & 0xF) == 0) & ((lo & 0xF) < 8) | ((hi >> 4) == 0) & ((lo >> 4) < 8)
    if mx.any(bad).item():
        row, byte = (int(i) for i in np.argwhere(np.array(bad))[0])
        raise _fail(
            f,
            name.removesuffix(".hi") + ".lo",
            f"int8 code below -128 at row {row}, byte {byte}: where the hi nibble is 0 "
            "(q4 = -8) the lo nibble must be >= 8 (qr >= 0)",
        )


def _check_had_k(f: Path, name: str, h: mx.array) -> None:
    hn = np.array(h, dtype=np.float64)
    k = hn.shape[0]
    if not np.all(np.abs(hn) == 1):
        raise _fail(f, name, "entries must all be +1 or -1")
    if not np.array_equal(hn @ hn.T, k * np.eye(k)):
        raise _fail(f, name, f"not a Hadamard matrix: H·Hᵀ != {k}·I")


def read(path: str | Path) -> Package:
    """Read and validate a package directory; PackageError names file, tensor, expectation."""
    path = Path(path)
    manifest_file = find_manifest(path)
    manifest = _read_json(manifest_file)
    if manifest.get("format") != FORMAT:
        raise PackageError(
            f"{manifest_file}: format is {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    if manifest.get("arch") not in ARCHS:
        raise PackageError(
            f"{manifest_file}: unknown arch {manifest.get('arch')!r}, expected one of {ARCHS}"
        )
    if not isinstance(manifest.get("layers"), dict):
        raise PackageError(f"{manifest_file}: missing the 'layers' object")
    if manifest.get("group_size", GROUP_SIZE) != GROUP_SIZE:
        raise PackageError(
            f"{manifest_file}: group_size {manifest['group_size']}, expected {GROUP_SIZE}"
        )
    config = _load_config(path, manifest, manifest_file)
    tensors = read_tensors(path)

    expected_linears = [
        f"model.layers.{i}.{lin}"
        for i in range(config["num_hidden_layers"])
        for lin in LAYER_LINEARS
    ] + ["lm_head"]
    missing = [n for n in expected_linears if n not in manifest["layers"]]
    if missing:
        raise PackageError(f"{manifest_file}: layers has no entry for {missing[0]}")

    used: set[str] = set()
    for name in expected_linears:
        entry = manifest["layers"][name]
        n, k = entry["shape"]
        if k % GROUP_SIZE:
            raise PackageError(
                f"{manifest_file}: {name} has K = {k}, which is not a multiple of {GROUP_SIZE}"
            )
        hi = _expect(tensors, f"{name}.hi", mx.uint8, (n, k // 2), path)
        lo = _expect(tensors, f"{name}.lo", mx.uint8, (n, k // 2), path)
        _expect(tensors, f"{name}.scales", mx.float16, (n, k // GROUP_SIZE), path)
        used |= {f"{name}.hi", f"{name}.lo", f"{name}.scales"}
        if entry.get("has_bias"):
            _expect(tensors, f"{name}.bias", (mx.float16, mx.float32), (n,), path)
            used.add(f"{name}.bias")
        _check_low_codes(tensors[f"{name}.hi"][0], f"{name}.hi", hi, lo)

    d, v = config["hidden_size"], config["vocab_size"]
    _expect(tensors, "model.embed_tokens.weight", mx.bfloat16, (v, d), path)
    used.add("model.embed_tokens.weight")

    for layer, spec in (manifest.get("online_hadamard") or {}).get("layers", {}).items():
        k = spec.get("K", 1)
        n = config["intermediate_size"]
        if n % k or not is_power_of_two(n // k):
            raise PackageError(
                f"{manifest_file}: online_hadamard {layer}: K = {k} but {n} is not K·2^k"
            )
        if k > 1:
            name = f"aux.had_K.{k}"
            _check_had_k(
                tensors[name][0] if name in tensors else path,
                name,
                _expect(tensors, name, mx.float32, (k, k), path),
            )
            used.add(name)

    for name, (f, a) in tensors.items():
        if name in used:
            continue
        if _ACT_ORDER_RE.search(name):
            raise _fail(
                f,
                name,
                "act-order / permutation tensors are not supported "
                "(bitnest-package-v1 groups are 128 contiguous columns)",
            )
        if name == "model.norm.weight" or _NORM_RE.fullmatch(name):
            if tuple(a.shape) != (d,):
                raise _fail(f, name, f"shape {list(a.shape)} but expected [{d}]")
            if not np.allclose(np.array(a.astype(mx.float32)), 1.0, atol=1e-3):
                if name == "model.norm.weight":
                    warnings.warn(
                        f"{f.name}: {name} is not ~1; it is not applied (norms are "
                        "fused into lm_head)",
                        stacklevel=2,
                    )
                else:
                    raise _fail(
                        f,
                        name,
                        "norm weight is not ~1: the package is unfused "
                        "(RMSNorm weights must be folded into the following Linears)",
                    )
            continue
        raise _fail(f, name, "unexpected tensor (not part of bitnest-package-v1)")

    return Package(path, manifest, config, {k: a for k, (_, a) in tensors.items()})


# ---------------------------------------------------------------------------------------------
# Writing


def _fold_norms(weights: Mapping[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """Fold RMSNorm gammas into the Linears that read them (exact), untie lm_head."""
    w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        g_attn = w.pop(p + "input_layernorm.weight")
        g_mlp = w.pop(p + "post_attention_layernorm.weight")
        for lin in ("q_proj", "k_proj", "v_proj"):
            w[f"{p}self_attn.{lin}.weight"] = w[f"{p}self_attn.{lin}.weight"] * g_attn
        for lin in ("gate_proj", "up_proj"):
            w[f"{p}mlp.{lin}.weight"] = w[f"{p}mlp.{lin}.weight"] * g_mlp
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    w["lm_head.weight"] = head * w.pop("model.norm.weight")
    return w


def _manifest(
    config: dict, arch: str, name: str, source: str | None, linears: dict, lm_head: Planes, k: int
) -> dict:
    n_layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    per_layer_group = {
        f"model.layers.{i}.{lin}": head_dim if lin.endswith("o_proj") else -1
        for i in range(n_layers)
        for lin in LAYER_LINEARS
    }
    return {
        "format": FORMAT,
        "model": name,
        "arch": arch,
        "source_model": source,
        "rotation": None,
        "group_size": GROUP_SIZE,
        "pack": "unsigned+8",
        "weight_planes": {
            "hi": "RTN-W4 code q4 in [-8,7], stored as u = q4+8",
            "lo": "signed residual qr in [-8,7] (in [0,7] where q4 = -8), stored as u = qr+8",
            "byte_layout": "uint8 [N, K/2]: low nibble of byte j = column 2j, high = column 2j+1",
            "draft": "W4 = (hi-8) * scale (scale fp16 [N,K/128], one group per 128 columns)",
            "target": "W8 = (16*(hi-8) + (lo-8)) * scale/16",
            "int8_code": "q8 = 16*q4 + qr in [-128,119]",
        },
        "activation": {
            "scheme": "symmetric int8, clip 1.0, per token (amax/127); o_proj input grouped per "
            f"head_dim={head_dim} per token",
            "per_layer_group": per_layer_group,
        },
        "online_hadamard": {
            "note": "R4: down_proj input gets a block Hadamard (K x 2^k, hadK in aux.had_K.<K>, "
            "normalised by 1/sqrt(dim)); no R1/R2 rotation in this package",
            "layers": {
                f"model.layers.{i}.mlp.down_proj": {"K": k, "fp32": False} for i in range(n_layers)
            },
        },
        "norms": {
            "fused": True,
            "decoder_norms_identity": True,
            "note": "RMSNorm weights folded into the following Linears; final norm folded into "
            "lm_head, model.norm.weight saved as ones",
        },
        "kv": {
            "nesting": "per (token, kv head) s = max|x|/7, q4 = clip(round(x/s)), "
            "qr = clip(round((x - q4 s)/(s/16))); draft reads q4 (KV4), target 16q4+qr (KV8)",
            "per_channel_offset": "none",
            "r3": "optional, off",
        },
        "rope": {
            "theta": config.get("rope_theta", 10000.0),
            "scaling": config.get("rope_scaling"),
            "max_position_embeddings": config.get("max_position_embeddings", 4096),
        },
        "layers": linears,
        "embed_note": "embed_tokens is the source embedding rounded to bf16 (no rotation)",
        "reference": {
            "loader": "bitnest_mlx.formats.bitnest.dequantize_planes",
            "gpu_runner": "bitnest_mlx.generate",
        },
        "lm_head_note": (
            "lm_head is an RTN dual plane (W4 + residual, gs128): draft reads W4, target W8, "
            f"activations A8 per token; residual saturation {100 * lm_head.saturation:.4f}%, "
            f"W8 max relative error {lm_head.w8_max_rel_err:.2e}, W4 relative Frobenius error "
            f"{lm_head.w4_rel_fro_err:.3f}; final norm folded in"
        ),
    }


def write(
    out_dir: str | Path,
    weights: Mapping[str, np.ndarray],
    config: dict,
    *,
    tokenizer_dir: str | Path | None = None,
    name: str | None = None,
    source_model: str | None = None,
) -> Path:
    """Write float Llama/Qwen2 weights (HF names) as a package: norms folded, R4 fused, RTN."""
    arch = config.get("model_type")
    if arch not in ARCHS:
        raise PackageError(f"model_type {arch!r} is not one of {ARCHS}")
    config = dict(config)
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    w = _fold_norms(weights, config)

    n_inter = config["intermediate_size"]
    k = split_k(n_inter)
    had = hadamard_k(k) if k > 1 else None
    tensors: dict[str, mx.array] = {}
    linears: dict[str, dict] = {}
    names = [
        f"model.layers.{i}.{lin}"
        for i in range(config["num_hidden_layers"])
        for lin in LAYER_LINEARS
    ] + ["lm_head"]
    lm_head = None
    for lin in names:
        wt = w[f"{lin}.weight"]
        if lin.endswith("down_proj"):
            wt = r4_transform(wt, had)  # W' = W Hᵀ, so W' (H a) = W a
        planes = quantize_planes(wt)
        tensors[f"{lin}.hi"] = mx.array(planes.hi)
        tensors[f"{lin}.lo"] = mx.array(planes.lo)
        tensors[f"{lin}.scales"] = mx.array(planes.scales)
        bias = w.get(f"{lin}.bias")
        if bias is not None:
            tensors[f"{lin}.bias"] = mx.array(bias.astype(np.float32))
        linears[lin] = {
            "shape": list(wt.shape),
            "groups": wt.shape[1] // GROUP_SIZE,
            "has_bias": bias is not None,
        }
        lm_head = planes
    tensors["model.embed_tokens.weight"] = mx.array(w["model.embed_tokens.weight"]).astype(
        mx.bfloat16
    )
    tensors["model.norm.weight"] = mx.ones((config["hidden_size"],), dtype=mx.float32)
    if had is not None:
        tensors[f"aux.had_K.{k}"] = mx.array(had.astype(np.float32))
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})

    manifest = _manifest(config, arch, name or out.name, source_model, linears, lm_head, k)
    (out / "bitnest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    package_config = {
        "model_type": "bitnest",
        "arch": arch,
        "hidden_size": config["hidden_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "intermediate_size": n_inter,
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "vocab_size": config["vocab_size"],
        "rms_norm_eps": config.get("rms_norm_eps", _DEFAULT_EPS[arch]),
        "rope_theta": config.get("rope_theta", 10000.0),
        "rope_scaling": config.get("rope_scaling"),
        "max_position_embeddings": config.get("max_position_embeddings", 4096),
        "tie_word_embeddings": False,
    }
    for key in ("bos_token_id", "eos_token_id"):
        if config.get(key) is not None:
            package_config[key] = config[key]
    (out / "config.json").write_text(json.dumps(package_config, indent=2) + "\n")
    if tokenizer_dir is not None:
        for fname in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / fname).is_file():
                shutil.copy(Path(tokenizer_dir) / fname, out / fname)
    return out
