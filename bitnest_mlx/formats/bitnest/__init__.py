"""bitnest-package-v1 (docs/bitnest-package.md): one name space over its parts.

`layout` (names, shapes, the error type), `numerics` (plane math, W8 = W4 + lo/16, A8),
`files` (manifest and safetensors access), `reader` (validation -> Package with a PackageSpec),
`spec` (the typed model description) and `writer` (planes -> files).
"""

from . import writer
from .files import find_manifest, is_package, read_tensors
from .layout import (
    ARCHS,
    CHECKSUMS_KEY,
    DEFAULT_EPS,
    FORMAT,
    INDEX_NAME,
    LAYER_LINEARS,
    MANIFEST_NAMES,
    NORMS_KEYS,
    TOKENIZER_FILES,
    PackageError,
    linear_shapes,
    norm_names,
    norm_readers,
)
from .manifest import derive_config
from .numerics import (
    KV_GROUPS,
    LO_STEP,
    SEED_GROUP_SIZE,
    W8_MAX,
    WEIGHT_GROUPS,
    Planes,
    a8,
    a8_codes,
    a8_scale,
    choose_group_size,
    dequantize_planes,
    nested,
    pack_nibbles,
    planes_from_codes,
    quantize_planes,
    unpack_nibbles,
    weight_scales,
)
from .reader import Package, read
from .sealing import seal
from .spec import PackageSpec

__all__ = [
    "ARCHS",
    "CHECKSUMS_KEY",
    "DEFAULT_EPS",
    "FORMAT",
    "SEED_GROUP_SIZE",
    "INDEX_NAME",
    "KV_GROUPS",
    "LAYER_LINEARS",
    "LO_STEP",
    "MANIFEST_NAMES",
    "NORMS_KEYS",
    "TOKENIZER_FILES",
    "W8_MAX",
    "WEIGHT_GROUPS",
    "Package",
    "PackageError",
    "PackageSpec",
    "Planes",
    "a8",
    "a8_codes",
    "a8_scale",
    "choose_group_size",
    "derive_config",
    "dequantize_planes",
    "find_manifest",
    "is_package",
    "linear_shapes",
    "nested",
    "norm_names",
    "norm_readers",
    "pack_nibbles",
    "planes_from_codes",
    "quantize_planes",
    "read",
    "read_tensors",
    "seal",
    "unpack_nibbles",
    "weight_scales",
    "writer",
]
