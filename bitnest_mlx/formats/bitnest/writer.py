"""Writing a package from quantized planes: safetensors, manifest, config.json, tokenizer files.

The float side (norm folding, R4 fusion, choosing codes) is the converter's
(`bitnest_mlx.convert.package.write_package`); this module only lays out what it is given.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from .layout import (
    DEFAULT_EPS,
    FORMAT,
    INDEX_NAME,
    LAYER_LINEARS,
    TOKENIZER_FILES,
    PackageError,
    linear_shapes,
    norm_names,
)
from .numerics import SEED_GROUP_SIZE, Planes, choose_group_size
from .sealing import write_manifest
from .segments import fsync_file, place_shard
from .spec import PackageSpec


def _manifest(
    config: dict,
    arch: str,
    name: str,
    source: str | None,
    linears: dict,
    k: int,
    r3: bool,
    kv_group: int | None,
    smoothing: bool,
    group_size: int = SEED_GROUP_SIZE,
) -> dict:
    n_layers = config["num_hidden_layers"]
    return {
        "format": FORMAT,
        "model": name,
        "arch": arch,
        "source_model": source,
        "rotation": None,
        "group_size": group_size,
        "pack": "unsigned+8",
        "weight_planes": _weight_planes(group_size),
        "activation": _activation(n_layers, config["head_dim"]),
        "online_hadamard": {
            "note": "R4: down_proj input gets a block Hadamard (K x 2^k, hadK in aux.had_K.<K>, "
            "normalised by 1/sqrt(dim)); no R1/R2 rotation in this package",
            "layers": {
                f"model.layers.{i}.mlp.down_proj": {"K": k, "fp32": False} for i in range(n_layers)
            },
        },
        "norms": _norms_block(smoothing),
        "kv": _kv_block(linears, r3, kv_group),
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
    }


def _weight_planes(group_size: int) -> dict:
    return {
        "hi": "W4 code q4 in [-8,7] (RTN unless 'conversion' says otherwise), u = q4+8",
        "lo": "signed residual qr in [-8,7] (in [0,7] where q4 = -8), stored as u = qr+8",
        "byte_layout": "uint8 [N, K/2]: low nibble of byte j = column 2j, high = column 2j+1",
        "draft": f"W4 = (hi-8) * scale (scale fp16 [N,K/{group_size}], one group per "
        f"{group_size} columns)",
        "target": "W8 = (16*(hi-8) + (lo-8)) * scale/16",
        "int8_code": "q8 = 16*q4 + qr in [-128,119]",
    }


def _activation(n_layers: int, head_dim: int) -> dict:
    per_layer_group = {
        f"model.layers.{i}.{lin}": head_dim if lin.endswith("o_proj") else -1
        for i in range(n_layers)
        for lin in LAYER_LINEARS
    }
    return {
        "scheme": "symmetric int8, clip 1.0, per token (amax/127); o_proj input grouped per "
        f"head_dim={head_dim} per token",
        "per_layer_group": per_layer_group,
    }


def _kv_block(linears: dict, r3: bool, kv_group: int | None) -> dict:
    return {
        "nesting": "per token and kv.group values of a head: s = max|x|/7, "
        "q4 = clip(round(x/s)), qr = clip(round((x - q4 s)/(s/16))); "
        "draft reads q4 (KV4), target 16q4+qr (KV8)",
        # Qwen2's k bias dominates K's per-token scale: K is cached without it (see models).
        "per_channel_offset": (
            "k_bias" if linears["model.layers.0.self_attn.k_proj"]["has_bias"] else "none"
        ),
        "r3": r3,
        **({"group": kv_group} if kv_group else {}),
    }


def _lm_head_note(lm_head: Planes) -> str:
    return (
        "lm_head is a dual plane (W4 + residual): draft reads W4, target W8, activations A8 per "
        f"token; residual saturation {100 * lm_head.saturation:.4f}%, W8 max relative error "
        f"{lm_head.w8_max_rel_err:.2e}, W4 relative Frobenius error "
        f"{lm_head.w4_rel_fro_err:.3f}; final norm folded in"
    )


def _norms_block(smoothing: bool) -> dict:
    if not smoothing:
        return {
            "fused": True,
            "decoder_norms_identity": True,
            "note": "RMSNorm weights folded into the following Linears; final norm folded into "
            "lm_head, model.norm.weight saved as ones",
        }
    return {
        "fused": True,
        "decoder_norms_identity": False,
        "smoothing": True,
        "note": "RMSNorm gammas folded into the following Linears; every norm then stores a "
        "per-channel smoothing vector d (float32) and the Linears that read it have their "
        "columns divided by d (docs/bitnest-package.md §2.5)",
    }


def _norm_tensors(norms: dict[str, np.ndarray], config: dict) -> dict[str, mx.array]:
    """All 2L + 1 norm weights as float32 [D]; a norm not in `norms` is ones (no smoothing)."""
    d = config["hidden_size"]
    out = {}
    for name in norm_names(config["num_hidden_layers"]):
        v = np.asarray(norms.get(name, np.ones(d)), dtype=np.float32)
        if v.shape != (d,) or not np.all(np.isfinite(v) & (v > 0)):
            raise PackageError(
                f"write: smoothing vector {name} has shape {list(v.shape)}; expected [{d}] of "
                "finite positive values"
            )
        out[name] = mx.array(v)
    unknown = sorted(set(norms) - set(out))
    if unknown:
        raise PackageError(f"write: {unknown[0]} is not a norm weight of this model")
    return out


class PackageWriter:
    """Writes a package tensor by tensor: each tensor goes into the current shard, and a shard is
    saved (and dropped from memory) once it holds `shard_bytes`, so a converter never holds more
    than one shard of packed planes. `finish` names the shards (`model.safetensors`, or
    `model-XXXXX-of-YYYYY.safetensors` + index), writes config.json, the manifest with its
    checksums and the tokenizer files, and refuses a package missing any tensor.

    The manifest is built up front from the config, so `spec` (what the runtime will read) is
    known before any weight is quantized: a converter calibrates with the model the package
    describes.

    With `segment_dir` (a resumable conversion) `checkpoint()` saves what the writer holds as a
    segment of the open shard there and returns the state `restore` takes back; the segments
    stay there after `finish` (joined into the package's shards), so a conversion killed
    while finishing can finish again from them.
    """

    def __init__(
        self,
        out_dir: str | Path,
        config: dict,
        *,
        biased: set[str] | frozenset[str] = frozenset(),
        had_k: np.ndarray | None,
        group_size: int = SEED_GROUP_SIZE,
        tokenizer_dir: str | Path | None = None,
        name: str | None = None,
        source_model: str | None = None,
        r3: bool = False,
        kv_group: int | None = None,
        norms: dict[str, np.ndarray] | None = None,
        shard_bytes: int = 2 * 2**30,
        segment_dir: str | Path | None = None,
    ):
        self.shapes = linear_shapes(config)
        try:  # the reader's rule (§2.1), checked before anything is written
            choose_group_size([k for _, k in self.shapes.values()], group_size)
        except ValueError as e:
            raise PackageError(f"write: {e}") from None
        self.out = Path(out_dir)  # created at the first shard: a refused input leaves nothing
        self.segment_dir = None if segment_dir is None else Path(segment_dir)
        self.config, self.tokenizer_dir, self.shard_bytes = config, tokenizer_dir, shard_bytes
        self.linears = {
            lin: {
                "shape": list(shape),
                "groups": shape[1] // group_size,
                "has_bias": lin in biased,
            }
            for lin, shape in self.shapes.items()
        }
        self.k = 1 if had_k is None else had_k.shape[0]
        self.manifest = _manifest(
            config,
            config["model_type"],
            name or self.out.name,
            source_model,
            self.linears,
            self.k,
            r3,
            kv_group,
            smoothing=norms is not None,
            group_size=group_size,
        )
        self.package_config = _package_config(config)
        self.expected = self._expected(biased, norms is not None)
        self._pending: dict[str, mx.array] = {}
        self._pending_bytes = 0
        # Per shard its saved segments (file name, tensor names); the last shard is open.
        self._shards: list[list[tuple[str, list[str]]]] = [[]]
        self._open_bytes = 0  # bytes in the open shard's saved segments
        self._written: set[str] = set()
        self._add_fixed(had_k, norms)

    def _expected(self, biased: set[str] | frozenset[str], smoothing: bool) -> set[str]:
        """Every tensor name the finished package must hold."""
        expected = {f"{lin}.{part}" for lin in self.shapes for part in ("hi", "lo", "scales")}
        expected |= {f"{lin}.bias" for lin in biased}
        expected |= {"model.embed_tokens.weight", "model.norm.weight"}
        if smoothing:
            expected |= set(norm_names(self.config["num_hidden_layers"]))
        return expected

    def _add_fixed(self, had_k: np.ndarray | None, norms: dict[str, np.ndarray] | None) -> None:
        """The tensors known before any weight: R4's Hadamard block and the norm weights."""
        if had_k is not None:
            self.add(f"aux.had_K.{self.k}", mx.array(had_k.astype(np.float32)))
        if norms is None:
            hidden = self.config["hidden_size"]
            self.add("model.norm.weight", mx.ones((hidden,), dtype=mx.float32))
        else:  # smoothing vectors (§2.5): every norm weight, ones where `norms` has none
            for name, v in _norm_tensors(dict(norms), self.config).items():
                self.add(name, v)

    @property
    def spec(self) -> PackageSpec:
        """The model description a reader will derive from this package."""
        return PackageSpec.from_package(self.manifest, self.package_config)

    @classmethod
    def spec_for(cls, config: dict, **kwargs) -> PackageSpec:
        """The spec of the package these arguments would write, without writing one (a writer
        touches its folder only at its first shard)."""
        return cls(Path(), config, **kwargs).spec

    def add(self, name: str, array: mx.array | np.ndarray) -> None:
        if name in self._written or name in self._pending:
            raise PackageError(f"write: tensor {name} given twice")
        a = array if isinstance(array, mx.array) else mx.array(array)
        mx.eval(a)
        self._pending[name] = a
        self._pending_bytes += a.nbytes
        if self._open_bytes + self._pending_bytes >= self.shard_bytes:
            self._flush(close=True)

    def add_linear(self, lin: str, planes: Planes, bias: np.ndarray | None = None) -> None:
        """One Linear's planes (and bias), checked against the shapes the config implies."""
        n, k = self.shapes[lin]
        groups = self.linears[lin]["groups"]
        for part, want in (("hi", (n, k // 2)), ("lo", (n, k // 2)), ("scales", (n, groups))):
            got = tuple(np.shape(getattr(planes, part)))
            if got != want:
                raise PackageError(
                    f"write: {lin}.{part} has shape {list(got)}; expected {list(want)}"
                )
        self.add(f"{lin}.hi", mx.array(planes.hi))
        self.add(f"{lin}.lo", mx.array(planes.lo))
        self.add(f"{lin}.scales", mx.array(planes.scales))
        if bias is not None:
            self.add(f"{lin}.bias", mx.array(np.asarray(bias, dtype=np.float32)))
        if lin == "lm_head":
            self.manifest["lm_head_note"] = _lm_head_note(planes)

    @property
    def _segments(self) -> Path:
        return self.out if self.segment_dir is None else self.segment_dir

    def _flush(self, close: bool = False) -> None:
        """Save the pending tensors as a segment of the open shard; `close`: start a new shard."""
        if self._pending:
            self._segments.mkdir(parents=True, exist_ok=True)
            shard = self._shards[-1]
            name = f".shard-{len(self._shards) - 1:05d}-{len(shard):04d}.safetensors"
            mx.save_safetensors(
                str(self._segments / name), self._pending, metadata={"format": "mlx"}
            )
            if self.segment_dir is not None:  # a record will name it: it must be on the disk
                fsync_file(self._segments / name)
            shard.append((name, list(self._pending)))
            self._written |= set(self._pending)
            self._open_bytes += self._pending_bytes
            self._pending, self._pending_bytes = {}, 0
        if close and self._shards[-1]:
            self._shards.append([])
            self._open_bytes = 0

    def checkpoint(self) -> dict:
        """Save every tensor given so far; returns the JSON-able state `restore` takes."""
        self._flush()
        shards = [[(name, list(names)) for name, names in shard] for shard in self._shards]
        return {"shards": shards, "open_bytes": self._open_bytes}  # a copy: the writer goes on

    def restore(self, state: dict) -> None:
        """Continue from a `checkpoint` of a writer of the same package whose segments are in
        `segment_dir`: the tensors saved then count as given (the aux and norm tensors this
        writer's construction added are among them)."""
        self._shards = [[(name, list(names)) for name, names in shard] for shard in state["shards"]]
        self._open_bytes = state["open_bytes"]
        self._written = {t for shard in self._shards for _, names in shard for t in names}
        self._pending = {k: v for k, v in self._pending.items() if k not in self._written}
        self._pending_bytes = sum(v.nbytes for v in self._pending.values())

    def finish(self, notes: dict | None = None) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        self._flush(close=True)
        missing = sorted(self.expected - self._written)
        if missing:
            raise PackageError(f"write: tensor {missing[0]} was never given")
        shards = [shard for shard in self._shards if shard]
        if len(shards) == 1:
            names = ["model.safetensors"]
        else:
            names = [
                f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
            ]
        weight_map = {}
        for shard, name in zip(shards, names):
            parts = [self._segments / segment for segment, _ in shard]
            place_shard(parts, self.out / name, keep=self.segment_dir is not None)
            weight_map.update({t: name for _, tensors in shard for t in tensors})
        files = [self.out / name for name in names]
        if len(shards) > 1:
            index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        if notes is not None:
            self.manifest["conversion"] = notes
        (self.out / "config.json").write_text(json.dumps(self.package_config, indent=2) + "\n")
        if self.tokenizer_dir is not None:
            for fname in TOKENIZER_FILES:
                if (Path(self.tokenizer_dir) / fname).is_file():
                    shutil.copy(Path(self.tokenizer_dir) / fname, self.out / fname)
        # Last: it records the bytes of every other file (§2.6).
        write_manifest(self.out / "bitnest.json", self.manifest, files, self.package_config)
        return self.out


def _package_config(config: dict) -> dict:
    arch = config["model_type"]
    package_config = {
        "model_type": "bitnest",
        "arch": arch,
        "hidden_size": config["hidden_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "intermediate_size": config["intermediate_size"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "vocab_size": config["vocab_size"],
        "rms_norm_eps": config.get("rms_norm_eps", DEFAULT_EPS[arch]),
        "rope_theta": config.get("rope_theta", 10000.0),
        "rope_scaling": config.get("rope_scaling"),
        "max_position_embeddings": config.get("max_position_embeddings", 4096),
        "tie_word_embeddings": False,
    }
    for key in ("bos_token_id", "eos_token_id"):
        if config.get(key) is not None:
            package_config[key] = config[key]
    return package_config


def write(
    out_dir: str | Path,
    config: dict,
    planes: dict[str, Planes],
    *,
    biases: dict[str, np.ndarray],
    embed: np.ndarray,
    had_k: np.ndarray | None,
    tokenizer_dir: str | Path | None = None,
    name: str | None = None,
    source_model: str | None = None,
    notes: dict | None = None,
    r3: bool = False,
    kv_group: int | None = None,
    norms: dict[str, np.ndarray] | None = None,
    group_size: int | None = None,
) -> Path:
    """Lay out a package: `planes` of every Linear (layers in order, lm_head last; down_proj with
    R4 fused by `had_k`, or None when intermediate_size is a power of two), their `biases`, the
    float `embed` (stored bf16) and an HF-style `config` with head_dim and rope keys resolved.

    `notes` (JSON-able) is recorded in the manifest as `conversion`; `r3` turns on the per-head
    Hadamard of q and k before the KV cache and `kv_group` sets the KV scale group (default
    head_dim). `norms` ({norm weight name: [D] positive}) stores smoothing vectors (§2.5): every
    norm weight is written (ones where not given) and the manifest says `norms.smoothing: true`;
    the Linears in `planes` must already have their columns divided by them. `group_size` is
    the weight group (None: what the planes' scales imply; every Linear must agree).
    """
    shapes = linear_shapes(config)
    if group_size is None:
        implied = {
            lin: shapes[lin][1] // max(np.shape(planes[lin].scales)[-1], 1) for lin in shapes
        }
        if len(set(implied.values())) != 1:
            first, *rest = implied.items()
            other = next(kv for kv in rest if kv[1] != first[1])
            raise PackageError(
                f"write: {first[0]} has group size {first[1]} but {other[0]} has {other[1]}; "
                "expected one group size for every Linear"
            )
        group_size = next(iter(implied.values()))
    w = PackageWriter(
        out_dir,
        config,
        biased={lin for lin in shapes if biases.get(lin) is not None},
        had_k=had_k,
        group_size=group_size,
        tokenizer_dir=tokenizer_dir,
        name=name,
        source_model=source_model,
        r3=r3,
        kv_group=kv_group,
        norms=norms,
    )
    for lin in shapes:
        w.add_linear(lin, planes[lin], biases.get(lin))
    w.add("model.embed_tokens.weight", mx.array(np.asarray(embed, np.float32)).astype(mx.bfloat16))
    return w.finish(notes)
