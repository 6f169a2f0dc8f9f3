"""What a conversion is asked for, as one value: `ConvertSettings` (every option that changes
the package, as `convert.convert` takes them) and `BuildSettings` (what `pipeline.build`
writes a source with). Frozen, so a step handed one cannot change what a later step reads."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from ..formats.bitnest import Planes
from .calib import CALIB_TOKENS
from .joint import W8_BUDGET
from .methods import Method
from .rotation import Rotation

# The CLI flag of each `Method.notes()` key: the resume record names settings as the user
# typed them, so its refusal says which flag to change.
_METHOD_FLAGS = {
    "method": "--method",
    "lo_method": "--lo",
    "w8_slack": "--w8-slack",
    "lambda_draft": "--lambda-draft",
    "w8_budget": "--w8-budget",
}


@dataclass(frozen=True)
class ConvertSettings:
    """Every option that changes the package (`cli/convert.py` gives each one's meaning; the
    field is the flag's name with `_` for `-`, `rotate_kind` for --rotate, `lo_method` for --lo).

    `smooth` searches per-norm smoothing vectors on the calibration text (`smoothing.py`).
    `draft_vocab`: the draft's reduced vocabulary (`draft_vocab.py`): "auto" (K by the bytes
    model), a K, or "full" (none)."""

    calib: str | Path | None = None
    method: str = "joint"
    rotate_kind: str = "hadamard"
    seed: int = 0
    calib_tokens: int = CALIB_TOKENS
    calib_seq_len: int = 256
    damp: float = 0.01
    lo_method: str = "gptq"
    w8_slack: float | None = 3.0
    lambda_draft: float | None = None
    w8_budget: float = W8_BUDGET
    r3: bool = True
    kv_group: int = 32
    smooth: bool = False
    group_size: int | None = None
    draft_vocab: int | str = "auto"

    def code_method(self) -> Method:
        """The code-selection settings (raises ValueError for an unknown method)."""
        return Method(
            self.method, self.damp, self.lo_method, self.w8_slack, self.lambda_draft, self.w8_budget
        )

    def flags(self) -> dict:
        """{CLI flag: value} of every setting that changes the package (a resumed conversion
        must have them all the same), the converter's version included: another version may
        choose other codes. The method's settings come as its manifest notes have them, so one
        that does not apply to the method (--w8-slack with joint) does not keep a conversion
        from resuming."""
        method = self.code_method()
        flags = {_METHOD_FLAGS[key]: value for key, value in method.notes().items()}
        flags["--damp"] = method.damp if method.calibrated else None
        text = Path(self.calib).read_bytes() if self.calib else None
        flags["--calib"] = hashlib.sha256(text).hexdigest()[:16] if text else "built-in"
        flags |= {
            "--rotate": self.rotate_kind,
            "--seed": self.seed,
            "--calib-tokens": self.calib_tokens,
            "--calib-seq-len": self.calib_seq_len,
            "--r3": "on" if self.r3 else "off",
            "--kv-group": self.kv_group,
            "--group-size": self.group_size or "auto",
            "--smooth": "on" if self.smooth else "off",
            "--draft-vocab": self.draft_vocab,
        }
        try:
            flags["bitnest-mlx"] = version("bitnest-mlx")
        except PackageNotFoundError:  # run from a source tree
            flags["bitnest-mlx"] = "source"
        return flags


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no single truth value
class BuildSettings:
    """How `pipeline.build` writes a source.

    `method` chooses the planes (a calibrated one needs `tokens` [n_seq, seq_len]); a
    `quantize(name, w)` callback overrides it (no calibration). `smoothing` is the norms'
    vectors (already chosen). `notes` is the manifest's `conversion` block; with `diagnostics`
    the build appends each Linear's diagnostics (`per_linear`) and the stages' resources to it,
    once every Linear is quantized."""

    method: Method = Method("rtn")
    quantize: Callable[[str, np.ndarray], Planes] | None = None
    rotation: Rotation | None = None
    tokens: np.ndarray | None = None
    smoothing: Mapping[str, np.ndarray] | None = None
    group_size: int | None = None
    name: str | None = None
    source_model: str | None = None
    notes: dict | None = None
    diagnostics: bool = False
    r3: bool = False
    kv_group: int | None = None
