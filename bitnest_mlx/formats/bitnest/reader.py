"""Reading and validating a package: every rule of docs/bitnest-package.md a file can break.

Pure I/O: knows the files, tensor names and integer maps, and nothing about the model forward.
Every refusal is a PackageError naming the file, the tensor and what was expected.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import checksums
from ..hadamard import is_power_of_two
from .draft_vocab import DRAFT_VOCAB, check_ids, draft_vocab_size
from .files import find_manifest, read_json, read_tensors
from .layout import (
    CHECKSUMS_KEY,
    INDEX_NAME,
    PackageError,
    linear_shapes,
    norm_names,
)
from .manifest import check_manifest, check_o_proj_group, load_config, weight_group
from .spec import PackageSpec

_NORM_RE = re.compile(r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight")
_ACT_ORDER_RE = re.compile(r"(g_idx|perm|act_order)")


@dataclass
class Package:
    """A validated package: its directory, manifest, config (read or derived), the typed model
    description and the tensors."""

    path: Path
    manifest: dict
    config: dict
    spec: PackageSpec
    tensors: dict[str, mx.array]

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]


def _check_linears(manifest: dict, config: dict, f: Path, dims_from: str) -> dict:
    """Every Linear the dims imply is listed with that shape, and nothing else is listed."""
    layers = manifest["layers"]
    expected = linear_shapes(config)
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
            raise _fail(f, name, f"dtype {_dt(a.dtype)} but expected {want}{why}")
        if tuple(a.shape) != tuple(shape):
            raise _fail(f, name, f"shape {list(a.shape)} but expected {want}{why}")
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
        "the following Linears and ones stored, or norms.smoothing: true in the manifest)",
    )


def _check_smoothing(f: Path, name: str, a: mx.array) -> None:
    """A stored norm weight multiplies the normalized stream: it must be finite and positive
    (its inverse is fused into the Linears that read it, §2.5)."""
    v = np.array(a)
    if (bad := np.flatnonzero(~(np.isfinite(v) & (v > 0)))).size:
        msg = f"value {v[bad[0]]} at channel {bad[0]}: expected a finite positive smoothing vector"
        raise _fail(f, name, msg)


def _described(path: Path) -> tuple[Path, dict, dict, int]:
    """(manifest file, manifest, config, draft vocabulary size) after the rules that read no
    tensor."""
    manifest_file = find_manifest(path)
    manifest = read_json(manifest_file)
    check_manifest(manifest, manifest_file)
    draft_vocab = draft_vocab_size(manifest, manifest_file)
    config = load_config(path, manifest, manifest_file)
    kv_group = (manifest.get("kv") or {}).get("group", config["head_dim"])
    if config["head_dim"] % kv_group:
        raise PackageError(
            f"{manifest_file}: kv.group = {kv_group} does not divide head_dim {config['head_dim']}"
        )
    return manifest_file, manifest, config, draft_vocab


def read_spec(path: str | Path) -> PackageSpec:
    """A package's model description from its manifest and config alone, no tensor read (sizes
    and bytes per token; `read` validates the whole package before anything runs on it)."""
    _, manifest, config, _ = _described(Path(path))
    return PackageSpec.from_package(manifest, config)


def read(path: str | Path, verify: bool = False) -> Package:
    """Read and validate a package directory; PackageError names file, tensor, expectation.

    `verify`: also hash the data against the manifest's checksums (§2.6), naming the first file
    that differs; without it only the checks that read no tensor data run."""
    path = Path(path)
    manifest_file, manifest, config, draft_vocab = _described(path)
    has_config = (path / "config.json").is_file()
    dims_from = "config.json" if has_config else f"the layer-0 shapes in {manifest_file.name}"
    linears = _check_linears(manifest, config, manifest_file, dims_from)
    check_o_proj_group(manifest, config, manifest_file)
    had_k = _had_k_needed(manifest, config, manifest_file)

    index = path / INDEX_NAME
    tensors = _Tensors(read_tensors(path), index if index.is_file() else path / "model.safetensors")
    _check_planes(tensors, linears, manifest, manifest_file)
    _check_aux(tensors, manifest, manifest_file, config, had_k, draft_vocab)
    _check_unused(tensors, linears, manifest_file, config["hidden_size"])

    # Last, so that a broken file is refused with the rule it breaks; the checksums decide only
    # about a package that is valid but not the one written (§2.6).
    config_file = path / "config.json"
    checksums.verify(
        manifest,
        manifest_file,
        CHECKSUMS_KEY,
        {name: f for name, (f, _) in tensors.found.items()},
        {"config.json": (config_file, read_json(config_file) if has_config else None)},
        PackageError,
        data=verify,
    )
    spec = PackageSpec.from_package(manifest, config)
    return Package(path, manifest, config, spec, {k: a for k, (_, a) in tensors.found.items()})


def _check_planes(tensors: _Tensors, linears: dict, manifest: dict, manifest_file: Path) -> None:
    """Each Linear's hi, lo, scales and bias, after refusing act-order tensors."""
    group = weight_group(manifest)
    # Act-order first: such a package usually breaks other rules too, and this is the real cause.
    for name, (f, _) in tensors.found.items():
        if _ACT_ORDER_RE.search(name):
            raise _fail(
                f,
                name,
                "act-order / permutation tensors are not supported (expected groups of "
                f"{group} contiguous columns)",
            )
    bias_dtypes, first_bias = (mx.float16, mx.float32), ""
    for name, (n, k) in linears.items():
        hi = tensors.expect(f"{name}.hi", mx.uint8, (n, k // 2))
        lo = tensors.expect(f"{name}.lo", mx.uint8, (n, k // 2))
        why = f"; {manifest_file.name}: group_size {group}"
        tensors.expect(f"{name}.scales", mx.float16, (n, k // group), why)
        if manifest["layers"][name].get("has_bias"):
            why = f"; {manifest_file.name} says has_bias: true{first_bias}"
            # Every bias has the first one's dtype: one stored in the other is refused, not cast.
            bias_dtypes = (tensors.expect(f"{name}.bias", bias_dtypes, (n,), why).dtype,)
            first_bias = first_bias or f", and {name}.bias is {_dt(bias_dtypes)}"
        _check_low_codes(tensors.file(f"{name}.lo"), f"{name}.lo", hi, lo)


def _check_aux(
    tensors: _Tensors,
    manifest: dict,
    manifest_file: Path,
    config: dict,
    had_k: dict[int, str],
    draft_vocab: int | None,
) -> None:
    """The embedding, R4's Hadamard blocks, smoothing vectors and the draft vocabulary."""
    d, v = config["hidden_size"], config["vocab_size"]
    tensors.expect("model.embed_tokens.weight", mx.bfloat16, (v, d))
    for k, layer in had_k.items():
        name = f"aux.had_K.{k}"
        why = f"; {manifest_file.name} gives {layer} K = {k}"
        h = tensors.expect(name, mx.float32, (k, k), why)
        _check_had_k(tensors.file(name), name, h)
    if (manifest.get("norms") or {}).get("smoothing") is True:
        for name in norm_names(config["num_hidden_layers"]):
            a = tensors.expect(name, mx.float32, (d,), f"; {manifest_file.name}: norms.smoothing")
            _check_smoothing(tensors.file(name), name, a)
    if draft_vocab:
        if draft_vocab > v:
            raise PackageError(
                f"{manifest_file}: draft.vocab_size = {draft_vocab}, expected at most the "
                f"vocabulary ({v})"
            )
        why = f"; {manifest_file.name}: draft.vocab_size {draft_vocab}"
        ids = tensors.expect(DRAFT_VOCAB, mx.int32, (draft_vocab,), why)
        check_ids(tensors.file(DRAFT_VOCAB), ids, v)
    elif DRAFT_VOCAB in tensors.found:
        raise _fail(
            tensors.file(DRAFT_VOCAB),
            DRAFT_VOCAB,
            f"a draft vocabulary, but {manifest_file.name} has no draft block (§2.9)",
        )


def _check_unused(tensors: _Tensors, linears: dict, manifest_file: Path, d: int) -> None:
    """Every tensor no rule above read: a norm weight (checked here), else refused."""
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
