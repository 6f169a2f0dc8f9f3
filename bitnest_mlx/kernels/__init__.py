"""Metal kernels for the decode hot paths, with the pure-MLX path as reference and fallback.

One module per kernel family plans its launches (`Launch`: inputs, template, grid, output
shapes) and hands them to a runner (`launch.py`); `dispatch.py` decides, per layer kind, whether
the kernel or the pure path serves a call.
"""

from .dispatch import SelfTest, check, record, report, use
from .dual_plane import (
    A8_QUANTIZE,
    DUAL_PLANE,
    LANE_COLS,
    MAX_M,
    a8_fusable,
    a8_quantize,
    dual_plane_matmul,
    dual_plane_supported,
)
from .head_hadamard import HEAD_HADAMARD, head_hadamard, head_hadamard_supported
from .hyper_connection import HC_POST, HC_PRE, hc_post, hc_pre, hc_supported
from .launch import KernelSpec, Launch, Runner, metal_runner, run
from .moe_route import MOE_ROUTE, moe_route
from .mxtq import (
    HADAMARD,
    MXTQ_GATHER,
    MXTQ_ROWS,
    MXTQ_SWIGLU,
    hadamard_rotate,
    hadamard_supported,
    mxtq_gather_matvec,
    mxtq_gather_supported,
    mxtq_gather_swiglu,
)
from .nested_kv import (
    NESTED_KV,
    NESTED_KV_MERGE,
    NESTED_KV_WRITE,
    KVGeometry,
    kv_geometry,
    nested_kv_attention,
    nested_kv_supported,
    nested_kv_write,
    nested_kv_write_supported,
)

SPECS = (
    DUAL_PLANE,
    A8_QUANTIZE,
    NESTED_KV,
    NESTED_KV_MERGE,
    NESTED_KV_WRITE,
    HEAD_HADAMARD,
    MXTQ_GATHER,
    MXTQ_SWIGLU,
    HADAMARD,
    HC_PRE,
    HC_POST,
    MOE_ROUTE,
)

__all__ = [
    "A8_QUANTIZE",
    "DUAL_PLANE",
    "HADAMARD",
    "HC_POST",
    "HC_PRE",
    "HEAD_HADAMARD",
    "LANE_COLS",
    "MAX_M",
    "MOE_ROUTE",
    "MXTQ_GATHER",
    "MXTQ_ROWS",
    "MXTQ_SWIGLU",
    "NESTED_KV",
    "NESTED_KV_MERGE",
    "NESTED_KV_WRITE",
    "SPECS",
    "KVGeometry",
    "KernelSpec",
    "Launch",
    "Runner",
    "SelfTest",
    "a8_fusable",
    "a8_quantize",
    "check",
    "dual_plane_matmul",
    "dual_plane_supported",
    "hadamard_rotate",
    "head_hadamard",
    "head_hadamard_supported",
    "hadamard_supported",
    "hc_post",
    "hc_pre",
    "hc_supported",
    "kv_geometry",
    "metal_runner",
    "moe_route",
    "mxtq_gather_matvec",
    "mxtq_gather_supported",
    "mxtq_gather_swiglu",
    "nested_kv_attention",
    "nested_kv_supported",
    "nested_kv_write",
    "nested_kv_write_supported",
    "record",
    "report",
    "run",
    "use",
]
