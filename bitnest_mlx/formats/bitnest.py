"""bitnest-package-v1: read, validate and write packages (spec: shared/specs/bitnest-package-v1.md).

Pure I/O: knows the files, tensor names and integer maps, and nothing about the model forward.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .hadamard import hadamard_k, is_power_of_two, r4_transform, split_k

FORMAT = "bitnest-package-v1"
MANIFEST_NAMES = ("bitnest.json", "manifest.json")
INDEX_NAME = "model.safetensors.index.json"
GROUP_SIZE = 128
KV_GROUPS = (32, 64, 128)
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
    """A validated package: its directory, manifest, config (read or derived) and tensors."""

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
    """RTN planes: the W8 code q8 = round(w/(s/16)) split into hi and lo nibbles (see
    `planes_from_codes`), s from `weight_scales`."""
    return planes_from_codes(w)


W8_MAX = 119 / 16  # the W8 grid spans [-8 s, 7.4375 s]: q8 = 16 q4 + qr in [-128, 119]


def weight_scales(w: np.ndarray) -> np.ndarray:
    """fp16 scales [N, K/128]: the smallest s whose W8 grid still holds every value of the group
    (max/7.4375 and -min/8), so W8 never clips and W4 gets a ~6 % finer step than amax/7."""
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"weight shape {[n, k]}: K must be a multiple of {GROUP_SIZE}")
    wg = w.astype(np.float32).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    s = np.maximum(wg.max(-1) / W8_MAX, -wg.min(-1) / 8)
    s16 = np.maximum(s, 2.0**-14).astype(np.float16)
    s16[s == 0] = 1
    return s16


def planes_from_codes(
    w: np.ndarray,
    codes: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    residual: np.ndarray | None = None,
) -> Planes:
    """Planes for weight `w` [N, K] from given hi codes q4 [N, K] and fp16 scales [N, K/128].

    Missing scales come from `weight_scales`. Missing codes are RTN of the W8 code:
    q8 = clip(round(w/(s/16)), -128, 119) and q4 = floor((q8 + 8)/16), its hi nibble, which is
    round(w/s) except within s/32 of a midpoint; so the residual below never clips. A missing
    `residual` (lo codes qr [N, K]) is the RTN residual of the original weight:
    qr = clip(round((w - q4 s)/(s/16)), -8, 7), kept >= 0 where q4 = -8 (q8 >= -128).
    """
    n, k = w.shape
    s16 = weight_scales(w) if scales is None else np.asarray(scales, dtype=np.float16)
    s16 = s16.reshape(n, k // GROUP_SIZE)
    wg = w.astype(np.float32).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    # Codes are computed from the fp16 scale actually stored, so dequantization is consistent.
    s = s16.astype(np.float32)[..., None]
    if codes is None:
        q8 = np.clip(np.round(wg / (s / 16)), -128, 119)
        q4 = np.floor((q8 + 8) / 16)
    else:
        q4 = np.asarray(codes, dtype=np.float32).reshape(wg.shape)
        if q4.min() < -8 or q4.max() > 7:
            raise ValueError(f"hi codes must lie in [-8, 7], got [{q4.min()}, {q4.max()}]")
    raw = np.round((wg - q4 * s) / (s / 16))
    if residual is None:
        qr = np.where(q4 == -8, np.clip(raw, 0, 7), np.clip(raw, -8, 7))
    else:
        qr = np.asarray(residual, dtype=np.float32).reshape(wg.shape)
        if qr.min() < -8 or qr.max() > 7 or np.any(qr[q4 == -8] < 0):
            raise ValueError("lo codes must lie in [-8, 7], and in [0, 7] where q4 = -8")
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
    """The package's one manifest file; PackageError when there is none or more than one."""
    path = Path(path)
    if not path.is_dir():
        raise PackageError(f"{path}: not a directory (a bitnest package is a directory)")
    found, ignored = [], []
    for name in MANIFEST_NAMES:
        f = path / name
        if not f.is_file():
            continue
        # manifest.json is a common name for unrelated JSON: it counts only with our format string.
        if name == "manifest.json" and _read_json(f).get("format") != FORMAT:
            ignored.append(name)
            continue
        found.append(f)
    if not found:
        hint = f"; {ignored[0]} is present but lacks that format string" if ignored else ""
        raise PackageError(
            f"{path}: no manifest: expected bitnest.json (or manifest.json with "
            f'"format": "{FORMAT}"){hint}'
        )
    if len(found) > 1:
        raise PackageError(
            f"{path}: two manifests ({', '.join(f.name for f in found)}); expected exactly one"
        )
    return found[0]


def is_package(path: str | Path) -> bool:
    """True when `path` is a directory with exactly one bitnest manifest (nothing else checked)."""
    try:
        find_manifest(Path(path))
    except PackageError:
        return False
    return True


def _read_json(f: Path) -> dict:
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackageError(f"{f}: unreadable JSON ({e})") from e
    if not isinstance(data, dict):
        raise PackageError(f"{f}: expected a JSON object, found {type(data).__name__}")
    return data


def _safetensors_files(path: Path) -> tuple[list[Path], Path | None, dict | None]:
    """(files, index file or None, the index's weight_map or None)."""
    index = path / INDEX_NAME
    single = path / "model.safetensors"
    if index.is_file():
        # Both would leave it open which copy of a tensor is meant (mlx-lm would load both).
        if single.is_file():
            raise PackageError(
                f"{path}: both model.safetensors and {INDEX_NAME}; expected one of the two"
            )
        weight_map = _read_json(index).get("weight_map")
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(v, str) for v in weight_map.values())
        ):
            raise PackageError(
                f"{index}: expected a non-empty 'weight_map' object (tensor name -> shard file)"
            )
        for tensor, shard in weight_map.items():
            if not (path / shard).is_file():
                raise PackageError(
                    f"{index}: weight_map puts tensor {tensor} in {shard}, which does not exist"
                )
        return sorted({path / f for f in weight_map.values()}), index, weight_map
    if single.is_file():
        return [single], None, None
    if sorted(path.glob("model-*-of-*.safetensors")):
        raise PackageError(f"{path}: sharded safetensors without {INDEX_NAME}")
    raise PackageError(f"{path}: no model.safetensors (or shards with {INDEX_NAME})")


def _check_safetensors(f: Path) -> None:
    """Header sanity and size, so a truncated file is named instead of failing deep in a load."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise PackageError(
                f"{f}: truncated safetensors file ({size} bytes; expected an 8-byte header length)"
            )
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise PackageError(
                f"{f}: truncated safetensors file: header says {n} bytes, file has {size}"
            )
        try:
            header = json.loads(fh.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, AttributeError, KeyError, TypeError, IndexError) as e:
            # ValueError covers JSONDecodeError and UnicodeDecodeError.
            raise PackageError(
                f"{f}: unreadable safetensors header ({type(e).__name__}: {e}); expected a JSON "
                "object of tensors with data_offsets"
            ) from e
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise PackageError(
            f"{f}: truncated safetensors file: its tensors need {need} bytes, file has {size}"
        )


def read_tensors(path: Path) -> dict[str, tuple[Path, mx.array]]:
    """All tensors of a package, each with the file it came from."""
    path = Path(path)
    files, index, weight_map = _safetensors_files(path)
    out: dict[str, tuple[Path, mx.array]] = {}
    for f in files:
        _check_safetensors(f)
        try:
            arrays = mx.load(str(f))
        except Exception as e:  # mlx raises RuntimeError/ValueError with its own wording
            raise PackageError(f"{f}: unreadable safetensors file ({e})") from e
        for name, a in arrays.items():
            if name in out:
                raise PackageError(
                    f"{f}: tensor {name} is also in {out[name][0].name}; expected it once"
                )
            out[name] = (f, a)
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in out or out[name][0] != path / shard:
                actual = f"it is in {out[name][0].name}" if name in out else "no shard has it"
                raise PackageError(
                    f"{index}: weight_map puts tensor {name} in {shard}, but {actual}"
                )
    return out


def derive_config(manifest: dict, where: str) -> dict:
    """Model dims from the manifest's `layers` shapes (head_dim = o_proj activation group = 128)."""
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
    head_dim = GROUP_SIZE
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


def _check_manifest(manifest: dict, f: Path) -> None:
    """Manifest-only rules: format, arch, group size and the well-formedness of `layers`."""
    if manifest.get("format") != FORMAT:
        raise PackageError(f"{f}: format is {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("arch") not in ARCHS:
        raise PackageError(f"{f}: unknown arch {manifest.get('arch')!r}, expected one of {ARCHS}")
    if manifest.get("group_size", GROUP_SIZE) != GROUP_SIZE:
        raise PackageError(f"{f}: group_size {manifest['group_size']}, expected {GROUP_SIZE}")
    layers = manifest.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise PackageError(f"{f}: expected a non-empty 'layers' object (Linear name -> shape)")
    for name, entry in layers.items():
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
        if k % GROUP_SIZE:
            raise PackageError(
                f"{f}: {name}: K = {k}, expected a multiple of {GROUP_SIZE} "
                f"(one scale per {GROUP_SIZE} columns)"
            )
        if entry.get("groups", k // GROUP_SIZE) != k // GROUP_SIZE:
            raise PackageError(
                f"{f}: {name}: groups = {entry['groups']!r}, expected K/{GROUP_SIZE} = "
                f"{k // GROUP_SIZE}"
            )
        if not isinstance(entry.get("has_bias", False), bool):
            raise PackageError(f"{f}: {name}: has_bias = {entry['has_bias']!r}, expected a bool")
    kv_group = (manifest.get("kv") or {}).get("group")
    if kv_group is not None and kv_group not in KV_GROUPS:
        raise PackageError(
            f"{f}: kv.group = {kv_group!r}, expected one of {KV_GROUPS} (MLX's group sizes)"
        )
    if (manifest.get("kv") or {}).get("per_channel_offset") == "k_bias":
        unbiased = [n for n, e in layers.items() if n.endswith("k_proj") and not e.get("has_bias")]
        if unbiased:
            raise PackageError(
                f"{f}: kv.per_channel_offset is 'k_bias' but {unbiased[0]} has no bias"
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
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise PackageError(f"{f}: expected head_dim, or hidden_size and num_attention_heads")
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
    return {**derived, **config, "arch": derived["arch"]}


def _linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
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


def _check_linears(manifest: dict, config: dict, f: Path, dims_from: str) -> dict:
    """Every Linear the dims imply is listed with that shape, and nothing else is listed."""
    layers = manifest["layers"]
    expected = _linear_shapes(config)
    for name, shape in expected.items():
        if name not in layers:
            raise PackageError(f"{f}: layers has no entry {name} (expected shape {list(shape)})")
        if tuple(layers[name]["shape"]) != shape:
            raise PackageError(
                f"{f}: {name}: shape {layers[name]['shape']} but {dims_from} implies {list(shape)}"
            )
    for name in layers:
        if name not in expected:
            raise PackageError(
                f"{f}: layers lists {name}, which is not a Linear of this "
                f"{config['num_hidden_layers']}-layer model (expected the 7 Linears of each "
                "layer and lm_head)"
            )
    return expected


def _had_k_needed(manifest: dict, config: dict, f: Path) -> dict[int, str]:
    """{K: first down_proj using it} for every K > 1 in online_hadamard, entries validated."""
    entries = (manifest.get("online_hadamard") or {}).get("layers") or {}
    if not isinstance(entries, dict):
        raise PackageError(f"{f}: online_hadamard.layers: expected an object (down_proj -> K)")
    n = config["intermediate_size"]
    downs = {f"model.layers.{i}.mlp.down_proj" for i in range(config["num_hidden_layers"])}
    needed: dict[int, str] = {}
    for layer, entry in entries.items():
        if layer not in downs:
            raise PackageError(
                f"{f}: online_hadamard lists {layer}; expected only this model's down_proj "
                "layers (R4 acts on the down_proj input)"
            )
        k = entry.get("K", 1) if isinstance(entry, dict) else None
        if not isinstance(k, int) or k < 1 or n % k or not is_power_of_two(n // k):
            raise PackageError(
                f"{f}: online_hadamard {layer}: K = {k!r}, expected K with intermediate_size "
                f"{n} = K·2^k"
            )
        if k > 1:
            needed.setdefault(k, layer)
    return needed


def _dt(dtype) -> str:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    return " or ".join(str(d).removeprefix("mlx.core.") for d in dtypes)


def _fail(f: Path, name: str, msg: str) -> PackageError:
    return PackageError(f"{f}: tensor {name}: {msg}")


class _Tensors:
    """A package's tensors, the file each came from, and the ones validation accounted for."""

    def __init__(self, found: dict[str, tuple[Path, mx.array]], source: Path):
        self.found = found
        self.source = source  # named when a tensor is missing: model.safetensors or the index
        self.used: set[str] = set()

    def file(self, name: str) -> Path:
        return self.found[name][0]

    def expect(self, name: str, dtype, shape: tuple[int, ...], why: str = "") -> mx.array:
        """The tensor, after checking it exists with this dtype (or one of them) and shape."""
        want = f"{_dt(dtype)} {list(shape)}"
        if name not in self.found:
            raise PackageError(f"{self.source}: missing tensor {name} (expected {want}{why})")
        f, a = self.found[name]
        if a.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
            raise _fail(f, name, f"dtype {_dt(a.dtype)} but expected {want}")
        if tuple(a.shape) != tuple(shape):
            raise _fail(f, name, f"shape {list(a.shape)} but expected {want}")
        self.used.add(name)
        return a


def _check_low_codes(f: Path, name: str, hi: mx.array, lo: mx.array) -> None:
    """u_lo must be >= 8 where u_hi == 0, else q8 = 16 q4 + qr < -128 (not an int8 code)."""
    bad_even = ((hi & 0xF) == 0) & ((lo & 0xF) < 8)  # column 2j: low nibbles
    bad_odd = ((hi >> 4) == 0) & ((lo >> 4) < 8)  # column 2j+1: high nibbles
    if mx.any(bad_even | bad_odd).item():
        cols = np.stack([np.array(bad_even), np.array(bad_odd)], -1).reshape(hi.shape[0], -1)
        row, col = (int(i) for i in np.argwhere(cols)[0])
        raise _fail(
            f,
            name,
            f"int8 code below -128 at row {row}, column {col}: expected u_lo >= 8 (qr >= 0) "
            "where u_hi == 0 (q4 = -8)",
        )


def _check_had_k(f: Path, name: str, h: mx.array) -> None:
    hn = np.array(h, dtype=np.float64)
    k = hn.shape[0]
    if not np.all(np.abs(hn) == 1):
        raise _fail(f, name, "expected every entry to be +1 or -1")
    if not np.array_equal(hn @ hn.T, k * np.eye(k)):
        raise _fail(f, name, f"not a Hadamard matrix: expected H·Hᵀ = {k}·I")


def _check_norm(f: Path, name: str, a: mx.array, d: int) -> None:
    """Norm weights are ~1 in a fused package; the final one is never applied, so only a warning."""
    if tuple(a.shape) != (d,):
        raise _fail(f, name, f"shape {list(a.shape)} but expected [{d}]")
    if np.allclose(np.array(a.astype(mx.float32)), 1.0, atol=1e-3):
        return
    if name == "model.norm.weight":
        warnings.warn(
            f"{f}: tensor {name} is not ~1; it is not applied (the final norm is fused into "
            "lm_head)",
            stacklevel=3,
        )
        return
    raise _fail(
        f,
        name,
        "norm weight is not ~1, so the package is unfused (expected RMSNorm weights folded into "
        "the following Linears and ones stored)",
    )


def read(path: str | Path) -> Package:
    """Read and validate a package directory; PackageError names file, tensor, expectation."""
    path = Path(path)
    manifest_file = find_manifest(path)
    manifest = _read_json(manifest_file)
    _check_manifest(manifest, manifest_file)
    config = _load_config(path, manifest, manifest_file)
    kv_group = (manifest.get("kv") or {}).get("group", config["head_dim"])
    if config["head_dim"] % kv_group:
        raise PackageError(
            f"{manifest_file}: kv.group = {kv_group} does not divide head_dim {config['head_dim']}"
        )
    has_config = (path / "config.json").is_file()
    dims_from = "config.json" if has_config else f"the layer-0 shapes in {manifest_file.name}"
    linears = _check_linears(manifest, config, manifest_file, dims_from)
    had_k = _had_k_needed(manifest, config, manifest_file)

    index = path / INDEX_NAME
    tensors = _Tensors(read_tensors(path), index if index.is_file() else path / "model.safetensors")
    # Act-order first: such a package usually breaks other rules too, and this is the real cause.
    for name, (f, _) in tensors.found.items():
        if _ACT_ORDER_RE.search(name):
            raise _fail(
                f,
                name,
                "act-order / permutation tensors are not supported (expected groups of "
                f"{GROUP_SIZE} contiguous columns)",
            )
    for name, (n, k) in linears.items():
        hi = tensors.expect(f"{name}.hi", mx.uint8, (n, k // 2))
        lo = tensors.expect(f"{name}.lo", mx.uint8, (n, k // 2))
        tensors.expect(f"{name}.scales", mx.float16, (n, k // GROUP_SIZE))
        if manifest["layers"][name].get("has_bias"):
            why = f"; {manifest_file.name} says has_bias: true"
            tensors.expect(f"{name}.bias", (mx.float16, mx.float32), (n,), why)
        _check_low_codes(tensors.file(f"{name}.lo"), f"{name}.lo", hi, lo)

    d, v = config["hidden_size"], config["vocab_size"]
    tensors.expect("model.embed_tokens.weight", mx.bfloat16, (v, d))
    for k, layer in had_k.items():
        name = f"aux.had_K.{k}"
        why = f"; {manifest_file.name} gives {layer} K = {k}"
        h = tensors.expect(name, mx.float32, (k, k), why)
        _check_had_k(tensors.file(name), name, h)

    for name, (f, a) in tensors.found.items():
        if name in tensors.used:
            continue
        if name == "model.norm.weight" or _NORM_RE.fullmatch(name):
            _check_norm(f, name, a, d)
            continue
        if name.endswith(".bias") and name.removesuffix(".bias") in linears:
            raise _fail(
                f,
                name,
                f"unexpected bias: {manifest_file.name} says has_bias: false for "
                f"{name.removesuffix('.bias')}",
            )
        raise _fail(f, name, "unexpected tensor (not part of bitnest-package-v1)")

    return Package(path, manifest, config, {k: a for k, (_, a) in tensors.found.items()})


# ---------------------------------------------------------------------------------------------
# Writing


def _rope_params(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from a config dict: transformers 5 nests both in `rope_parameters`."""
    theta, scaling = config.get("rope_theta"), config.get("rope_scaling")
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return (10000.0 if theta is None else float(theta)), scaling


def fold_norms(weights: Mapping[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """Fold every RMSNorm gamma into the Linears that read it (exact); the norms become ones and
    lm_head is untied (it absorbs the final norm)."""
    w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for norm, linears in (
            ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ):
            gamma = w[f"{p}{norm}.weight"]
            for lin in linears:
                w[f"{p}{lin}.weight"] = w[f"{p}{lin}.weight"] * gamma
            w[f"{p}{norm}.weight"] = np.ones_like(gamma)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    w["lm_head.weight"] = head * w["model.norm.weight"]
    w["model.norm.weight"] = np.ones_like(w["model.norm.weight"])
    return w


def _manifest(
    config: dict,
    arch: str,
    name: str,
    source: str | None,
    linears: dict,
    lm_head: Planes,
    k: int,
    r3: bool,
    kv_group: int | None,
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
            "hi": "W4 code q4 in [-8,7] (RTN unless 'conversion' says otherwise), u = q4+8",
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
            "nesting": "per token and kv.group values of a head: s = max|x|/7, "
            "q4 = clip(round(x/s)), qr = clip(round((x - q4 s)/(s/16))); "
            "draft reads q4 (KV4), target 16q4+qr (KV8)",
            # Qwen2's k bias dominates K's per-token scale: K is cached without it (see models).
            "per_channel_offset": (
                "k_bias" if linears["model.layers.0.self_attn.k_proj"]["has_bias"] else "none"
            ),
            "r3": r3,
            **({"group": kv_group} if kv_group else {}),
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
            "lm_head is a dual plane (W4 + residual, gs128): draft reads W4, target W8, "
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
    quantize: Callable[[str, np.ndarray], Planes] | None = None,
    notes: dict | None = None,
    r3: bool = False,
    kv_group: int | None = None,
) -> Path:
    """Write float Llama/Qwen2 weights (HF names) as a package: norms folded, R4 fused, RTN.

    `quantize(name, w)` replaces RTN (e.g. GPTQ hi codes via `planes_from_codes`); it is called
    once per Linear in forward order (layer 0 q, k, v, o, gate, up, down, layer 1, ..., lm_head)
    with the weight as stored (norms folded, R4 fused into down_proj). `notes` (JSON-able) is
    recorded in the manifest as `conversion`. `r3` turns on the per-head Hadamard of q and k
    before the KV cache and `kv_group` sets the KV cache's scale group (default head_dim); the
    weights do not change.
    """
    arch = config.get("model_type")
    if arch not in ARCHS:
        raise PackageError(f"model_type {arch!r} is not one of {ARCHS}")
    config = dict(config)
    config["rope_theta"], config["rope_scaling"] = _rope_params(config)
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    names = [
        f"model.layers.{i}.{lin}"
        for i in range(config["num_hidden_layers"])
        for lin in LAYER_LINEARS
    ] + ["lm_head"]
    # Checked up front so a bad input fails before any file is written.
    required = [f"{lin}.weight" for lin in names[:-1]] + [
        f"model.layers.{i}.{norm}.weight"
        for i in range(config["num_hidden_layers"])
        for norm in ("input_layernorm", "post_attention_layernorm")
    ]
    required += ["model.embed_tokens.weight", "model.norm.weight"]
    missing = [n for n in required if n not in weights]
    if missing:
        raise PackageError(f"write: missing float weight {missing[0]} (expected HF tensor names)")
    # The reader derives every shape from the config dims: a weight that disagrees would give a
    # package that `read` refuses, so refuse it here, naming the weight.
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    for lin, shape in _linear_shapes(config).items():
        wname = head if lin == "lm_head" else f"{lin}.weight"
        got = list(np.shape(weights[wname]))
        if got != list(shape):
            raise PackageError(f"write: {wname} has shape {got}; the config implies {list(shape)}")
        if shape[1] % GROUP_SIZE:
            raise PackageError(
                f"write: {wname} has shape {got}; expected K (the last dim) to be a multiple of "
                f"{GROUP_SIZE}"
            )
    n_inter = config["intermediate_size"]
    try:
        k = split_k(n_inter)
    except ValueError as e:
        raise PackageError(f"write: {e}") from e
    had = hadamard_k(k) if k > 1 else None

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    w = fold_norms(weights, config["num_hidden_layers"])
    tensors: dict[str, mx.array] = {}
    linears: dict[str, dict] = {}
    lm_head = None
    for lin in names:
        wt = w[f"{lin}.weight"]
        if lin.endswith("down_proj"):
            # Rows get x -> T x with T = (hadK ⊗ H)/sqrt(n) orthogonal: W' = W Tᵀ, W' (T a) = W a.
            wt = r4_transform(wt, had)
        planes = quantize(lin, wt) if quantize is not None else quantize_planes(wt)
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
        if lin == "lm_head":
            lm_head = planes  # its diagnostics go into the manifest's lm_head_note
    tensors["model.embed_tokens.weight"] = mx.array(w["model.embed_tokens.weight"]).astype(
        mx.bfloat16
    )
    tensors["model.norm.weight"] = mx.ones((config["hidden_size"],), dtype=mx.float32)
    if had is not None:
        tensors[f"aux.had_K.{k}"] = mx.array(had.astype(np.float32))
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})

    manifest = _manifest(
        config, arch, name or out.name, source_model, linears, lm_head, k, r3, kv_group
    )
    if notes is not None:
        manifest["conversion"] = notes
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
