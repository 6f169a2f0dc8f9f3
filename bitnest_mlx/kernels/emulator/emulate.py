"""Run `bitnest_mlx.kernels` launches on the CPU: the exact Metal source MLX generates, as C++.

1. `capture(launch)`: calls the real `mx.fast.metal_kernel` inside `mx.export_function` tracing
   with verbose=True, where MLX prints the full generated source (header, signature with buffer
   indices and attributes, body, template instantiation) instead of failing for lack of Metal.
2. `compile_source`: that text between metal_emu_begin.h / metal_emu_end.h, plus a generated
   launcher that binds buffer i to bufs[i] and each attribute to the emulated thread's value,
   built with g++ into a shared library (kept by content hash in one folder per user).
3. `run(launch)`: NumPy buffers in MLX's order, outputs poisoned (NaN / 0xAB bytes) unless the
   launch has an init_value, so an unwritten output element shows up.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..launch import Launch, metal_runner

HERE = Path(__file__).parent


def cxx() -> str:
    """The C++ compiler the emulator builds kernels with (`BITNEST_EMU_CXX`, default g++),
    read at each build so a process may change it."""
    return os.environ.get("BITNEST_EMU_CXX", "g++")


_NP = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,  # bit pattern; the emulator's bfloat16_t is a uint16 holder
    mx.int32: np.int32,
    mx.uint32: np.uint32,
    mx.int64: np.int64,
    mx.uint64: np.uint64,
    mx.int16: np.int16,
    mx.uint16: np.uint16,
    mx.int8: np.int8,
    mx.uint8: np.uint8,
    mx.bool_: np.bool_,
}

# Metal attribute -> C++ expression over emu::Thread `t` (see emu::launch).
_ATTRS = {
    "thread_position_in_grid": "t.tpig",
    "thread_position_in_threadgroup": "t.tpitg",
    "threadgroup_position_in_grid": "t.tgpig",
    "thread_index_in_threadgroup": "t.index_in_tg",
    "thread_index_in_simdgroup": "(t.index_in_tg % 32u)",
    "simdgroup_index_in_threadgroup": "(t.index_in_tg / 32u)",
    "thread_index_in_quadgroup": "(t.index_in_tg % 4u)",
    "quadgroup_index_in_threadgroup": "(t.index_in_tg / 4u)",
    "threads_per_simdgroup": "32u",
    "thread_execution_width": "32u",
    "threads_per_threadgroup": "t.tg_size",
    "dispatch_threads_per_threadgroup": "t.tg_size",
    "threads_per_grid": "grid3",
    "grid_size": "grid3",
    "grid_origin": "uint3{0u, 0u, 0u}",
    "threadgroups_per_grid": "groups3",
    "simdgroups_per_threadgroup": "((t.tg_size.x * t.tg_size.y * t.tg_size.z + 31u) / 32u)",
    "dispatch_simdgroups_per_threadgroup": "((tg3.x * tg3.y * tg3.z + 31u) / 32u)",
    "quadgroups_per_threadgroup": "((t.tg_size.x * t.tg_size.y * t.tg_size.z + 3u) / 4u)",
    "dispatch_quadgroups_per_threadgroup": "((tg3.x * tg3.y * tg3.z + 3u) / 4u)",
}

_PARAM = re.compile(
    r"^\s*(?P<type>.+?)\s*(?P<name>\w+)\s*\[\[(?P<attr>\w+)(?:\((?P<idx>\d+)\))?\]\]"
)


def _np(a) -> np.ndarray:
    if isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
        return np.ascontiguousarray(np.array(a))
    if isinstance(a, bool):
        return np.array(a, dtype=np.bool_)
    if isinstance(a, int):
        return np.array(a, dtype=np.int32)
    return np.array(a, dtype=np.float32)


def capture(launch: Launch) -> str:
    """The Metal source MLX generates for this launch (header, signature, body, instantiation)."""
    arrays = [a for a in launch.inputs if isinstance(a, mx.array)]

    def traced(*args):
        it = iter(args)
        inputs = [next(it) if isinstance(a, mx.array) else a for a in launch.inputs]
        plan = Launch(**{**launch.__dict__, "inputs": inputs})
        return metal_runner(plan, verbose=True)

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as out:
        # MLX prints through C++ std::cout: redirect file descriptor 1, not sys.stdout.
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            mx.export_function(os.path.join(tmp, "k.mlxfn"), traced, *arrays)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        text = out.read().decode()
    m = re.search(r"Generated source code for `[^`]*`:\n```\n(.*?)\n```", text, re.S)
    if not m:
        raise RuntimeError(f"MLX did not print a generated source:\n{text[:2000]}")
    return m.group(1)


def parse_signature(source: str) -> tuple[str, list[dict]]:
    """(call expression with template args, params [{type, name, attr, idx}]) of the kernel."""
    sig = re.search(r"\[\[kernel\]\] void (\w+)\((.*?)\) \{", source, re.S)
    if not sig:
        raise ValueError("no [[kernel]] signature in the generated source")
    # Templated kernels are called through their one explicit instantiation.
    inst = re.search(r"decltype\((\w+<.*?>)\)\s*\w+", source)
    params = []
    for line in sig.group(2).split(",\n"):
        p = _PARAM.match(line)
        if not p:
            raise ValueError(f"cannot parse kernel parameter {line!r}")
        params.append(p.groupdict())
    return (inst.group(1) if inst else sig.group(1)), params


def launcher(source: str) -> str:
    call, params = parse_signature(source)
    args = []
    for p in params:
        if p["attr"] == "buffer":
            ty, i = p["type"], p["idx"]
            args.append(f"*({ty[:-1]}*)bufs[{i}]" if ty.endswith("&") else f"({ty})bufs[{i}]")
        else:
            args.append(_ATTRS[p["attr"]])
    return f"""
extern "C" int emu_launch(void** bufs, const unsigned* grid, const unsigned* tg,
                          const char** err) {{
  const uint3 grid3{{grid[0], grid[1], grid[2]}}, tg3{{tg[0], tg[1], tg[2]}};
  const uint3 groups3{{(grid[0] + tg[0] - 1) / tg[0], (grid[1] + tg[1] - 1) / tg[1],
                       (grid[2] + tg[2] - 1) / tg[2]}};
  (void)grid3; (void)tg3; (void)groups3;
  return emu::launch(grid, tg, [=](const emu::Thread& t) {{ {call}({", ".join(args)}); }}, err);
}}
"""


def translation_unit(source: str, text: str | None = None) -> str:
    """The C++ file for `source`: its `text` (the source itself unless a build edits it) and a
    launcher for its kernel."""
    return (
        '#include "metal_emu.h"\n#include "metal_emu_begin.h"\n'
        + (source if text is None else text)
        + "\n"
        + launcher(source)
        + '#include "metal_emu_end.h"\n'
    )


@cache
def build_dir() -> Path:
    """Where compiled libraries are kept, shared by this user's processes: each is named by the
    hash of everything it is built from, and written under a private name then renamed, so
    processes never see a partial library and never rebuild one another's (one folder, not
    one per process left behind in the temp directory)."""
    path = Path(tempfile.gettempdir()) / f"bitnest-metal-emu-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


@cache
def _headers() -> str:
    """The emulator's headers: a library built against older ones must not be reused."""
    return "".join(f.read_text() for f in sorted(HERE.glob("*.h")))


def compile_source(source: str) -> ctypes.CDLL:
    """g++-compile the generated source with its launcher; one library per distinct text."""
    tu = translation_unit(source)
    digest = hashlib.sha256((cxx() + _headers() + tu).encode()).hexdigest()[:16]
    lib = build_dir() / f"k{digest}.so"
    if not lib.exists():
        private = build_dir() / f"k{digest}.{os.getpid()}"
        src = private.with_suffix(".cpp")
        src.write_text(tu)
        cmd = [cxx(), "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-attributes"]
        cmd += ["-I", str(HERE), "-o", str(private) + ".so", str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        src.unlink()
        if r.returncode:
            raise RuntimeError(f"emulator compile failed:\n{r.stderr[-4000:]}")
        os.replace(str(private) + ".so", lib)
    return load(str(lib))


@cache
def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.emu_launch.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(ctypes.c_char_p),
    ]
    return lib


class EmulatorError(RuntimeError):
    pass


def generated(launch: Launch, mutate: Callable[[str], str] | None = None) -> str:
    """The launch's generated source, edited by `mutate` first when given (for tests)."""
    source = capture(launch)
    if mutate is not None:
        mutated = mutate(source)
        if mutated == source:
            raise ValueError("mutation did not change the kernel source")
        source = mutated
    return source


def run(launch: Launch, mutate: Callable[[str], str] | None = None) -> list[mx.array]:
    """Execute `launch` in the emulator; `mutate` edits the generated source first (for tests)."""
    source = generated(launch, mutate)
    return execute(launch, source, compile_source(source))


def execute(launch: Launch, source: str, lib: ctypes.CDLL) -> list[mx.array]:
    """Run `lib` (built from `source`, any build) over the launch's buffers; its outputs."""
    _, params = parse_signature(source)
    named = dict(zip(launch.spec.input_names, launch.inputs))
    outputs = {}
    for name, shape, dtype in zip(
        launch.spec.output_names, launch.output_shapes, launch.output_dtypes
    ):
        out = np.empty(shape, dtype=_NP[dtype])
        if launch.init_value is not None:
            out[...] = launch.init_value
        elif out.dtype.kind == "f":
            out[...] = np.nan
        else:
            out.view(np.uint8)[...] = 0xAB
        outputs[name] = out
    keep, bufs = [], {}
    for p in params:
        if p["attr"] != "buffer":
            continue
        name = p["name"]
        if name in outputs:
            a = outputs[name]
        elif name in named:
            a = _np(named[name])
        else:
            base, _, what = name.rpartition("_")
            src = named[base]
            shape = src.shape if isinstance(src, mx.array) else ()
            if what == "shape":
                a = np.array(shape, dtype=np.int32)
            elif what == "strides":
                a = np.array([int(np.prod(shape[i + 1 :])) for i in range(len(shape))], np.int64)
            else:
                a = np.array(len(shape), dtype=np.int32)
        keep.append(a)
        bufs[int(p["idx"])] = a.ctypes.data
    ptrs = (ctypes.c_void_p * len(bufs))(*[bufs[i] for i in range(len(bufs))])
    err = ctypes.c_char_p()
    rc = lib.emu_launch(
        ptrs,
        (ctypes.c_uint * 3)(*launch.grid),
        (ctypes.c_uint * 3)(*launch.threadgroup),
        ctypes.byref(err),
    )
    if rc:
        raise EmulatorError(f"{err.value.decode()} (generated source line {rc})")
    result = []
    for name, dtype in zip(launch.spec.output_names, launch.output_dtypes):
        a = mx.array(outputs[name])
        result.append(a.view(mx.bfloat16) if dtype == mx.bfloat16 else a)
    return result
