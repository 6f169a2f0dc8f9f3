"""How one Linear's planes are chosen: rounding to nearest, GPTQ on the hi plane then the lo
plane, or the joint W4/W8 codes (`joint.py`), from the Linear's input Hessian."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats.bitnest import Planes, planes_from_codes
from .gptq import gptq_codes, gptq_residual_codes
from .joint import W8_BUDGET, budgeted_joint_planes, joint_codes, output_errors_vs_rtn
from .sweep import Factor

METHODS = ("joint", "gptq", "rtn")


@dataclass(frozen=True)
class Method:
    """The converter's code-selection settings (see `cli/convert.py` for each one's meaning)."""

    name: str = "joint"  # the one method that bounds the target (docs/convert.md, item 7)
    damp: float = 0.01
    lo_method: str = "gptq"
    w8_slack: float | None = 3.0
    lambda_draft: float | None = None
    w8_budget: float = W8_BUDGET

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"unknown method {self.name!r}; expected one of {METHODS}")

    @property
    def calibrated(self) -> bool:
        return self.name != "rtn"

    def notes(self) -> dict:
        joint, auto = self.name == "joint", self.lambda_draft is None
        return {
            "method": self.name,
            "lo_method": {"gptq": self.lo_method, "rtn": "rtn"}.get(self.name, "joint"),
            "w8_slack": self.w8_slack if self.name == "gptq" else None,
            "lambda_draft": (self.lambda_draft or "auto") if joint else None,
            "w8_budget": self.w8_budget if joint and auto else None,
        }

    def quantize(
        self,
        w: np.ndarray,
        h: np.ndarray | None,
        group_size: int,
        factors: dict[tuple[int, bool], Factor],
    ) -> tuple[Planes, dict[str, float]]:
        """Planes of weight `w` [N, K] and its output errors against RTN's on `h` [K, K].

        `factors` caches each Hessian's factor for the Linears that share it (q/k/v, gate/up):
        pass one dict per layer."""
        if not self.calibrated:
            return planes_from_codes(w, group_size=group_size), {}
        assert h is not None, f"method {self.name} needs a Hessian"

        def factor(act_order: bool = False) -> Factor:
            key = (id(h), act_order)
            if key not in factors:
                factors[key] = Factor(h, self.damp, act_order)
            return factors[key]

        if self.name == "joint" and self.lambda_draft is None:
            planes, lam, errors = budgeted_joint_planes(
                w, factor(), self.w8_budget, self.damp, group_size=group_size
            )
            return planes, {**errors, "lambda_draft": lam}
        if self.name == "joint":
            codes, residual, scales = joint_codes(
                w, factor(), self.lambda_draft, self.damp, group_size=group_size
            )
        else:
            codes, scales = gptq_codes(w, factor(), self.damp, self.w8_slack, group_size=group_size)
            residual = None
            if self.lo_method == "gptq":
                residual = gptq_residual_codes(w, codes, scales, factor(True), self.damp)
        planes = planes_from_codes(w, codes, scales, residual)
        return planes, output_errors_vs_rtn(w, planes, h)
