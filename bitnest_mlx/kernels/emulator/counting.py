"""Count the operations a kernel launch executes, by class, in the CPU emulator.

The generated source is compiled by clang at -O2 (no vectorisation: a GPU thread is scalar) to
LLVM IR, with Metal's address spaces kept as clang address spaces. Each basic block of the
kernel (and of any helper that was not inlined) gets a call that counts its executions; the
instrumented IR is then compiled and run like any emulator build. Executed operations are the
block counts times each block's instructions, so they follow the real control flow (loop trip
counts, branches, ragged edges), after the constant folding, unrolling and hoisting an
LLVM-based compiler does. Metal's compiler is LLVM-based too, but its exact choices (unrolling,
instruction selection) are not these: the counts are an estimate of its work, not its ISA.

Every lane counts its own operations, as on a SIMT GPU. Not counted: address arithmetic folded
into loads (getelementptr), integer width changes (sext/zext/trunc) and bit casts, which cost
nothing or are x86 artefacts. The emulator's scheduler (simd exchange, barriers) is runtime: its
builtins are counted as calls, not by their CPU implementation.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import mlx.core as mx

from ..launch import Launch
from . import emulate


def clang() -> str:
    """The clang++ of the counting builds (`BITNEST_EMU_CLANG`, default clang++), read at
    each build so a process may change it."""
    return os.environ.get("BITNEST_EMU_CLANG", "clang++")


# -O2 without vectorisation (a GPU thread is scalar); a high unroll threshold because GPU
# compilers fully unroll short constant-trip loops, which x86's default would leave as loops
# whose counters and index arithmetic a Metal build does not execute.
OPT = ["-O2", "-fno-vectorize", "-fno-slp-vectorize", "-mllvm", "-unroll-threshold=2000"]

# Operation classes, in report order.
CLASSES = (
    "fma",
    "fadd",
    "fmul",
    "int_mul",
    "int_add",
    "cmp_select",
    "shift",
    "mask",
    "convert",
    "fp_convert",
    "round",
    "div",
    "transcendental",
    "simd",
    "barrier",
    "device_read_bytes",
    "device_write_bytes",
    "threadgroup_bytes",
    "private_bytes",
)

_OPCODES = {
    "fadd": "fadd",
    "fsub": "fadd",
    "fneg": "fadd",
    "fmul": "fmul",
    "mul": "int_mul",
    "add": "int_add",
    "sub": "int_add",
    "icmp": "cmp_select",
    "fcmp": "cmp_select",
    "select": "cmp_select",
    "shl": "shift",
    "lshr": "shift",
    "ashr": "shift",
    "and": "mask",
    "or": "mask",
    "xor": "mask",
    "sitofp": "convert",
    "uitofp": "convert",
    "fptosi": "convert",
    "fptoui": "convert",
    "fpext": "fp_convert",
    "fptrunc": "fp_convert",
    "fdiv": "div",
    "frem": "div",
    "sdiv": "div",
    "udiv": "div",
    "srem": "div",
    "urem": "div",
}

_DIVISIONS = ("sdiv", "udiv", "srem", "urem")

# Callee name (LLVM intrinsic or libm, after the `llvm.` prefix and type suffix) -> class.
_CALLS = {
    "fmuladd": "fma",
    "fma": "fma",
    "fmaf": "fma",
    "rint": "round",
    "rintf": "round",
    "nearbyint": "round",
    "roundeven": "round",
    "round": "round",
    "roundf": "round",
    "floor": "round",
    "floorf": "round",
    "ceil": "round",
    "ceilf": "round",
    "trunc": "round",
    "exp": "transcendental",
    "expf": "transcendental",
    "exp2": "transcendental",
    "exp2f": "transcendental",
    "log": "transcendental",
    "logf": "transcendental",
    "log2": "transcendental",
    "log2f": "transcendental",
    "sqrt": "transcendental",
    "sqrtf": "transcendental",
    "pow": "transcendental",
    "powf": "transcendental",
    "sin": "transcendental",
    "cos": "transcendental",
    "smin": "cmp_select",
    "smax": "cmp_select",
    "umin": "cmp_select",
    "umax": "cmp_select",
    "minnum": "cmp_select",
    "maxnum": "cmp_select",
    "fabs": "cmp_select",
    "abs": "cmp_select",
    "ctpop": "mask",
    "fshl": "shift",
    "fshr": "shift",
}
_RUNTIME_CALLS = (
    ("simd_", "simd"),
    ("threadgroup_barrier_at", "barrier"),
    ("simdgroup_barrier_at", "barrier"),
)
_FREE_CALLS = ("lifetime.", "dbg.", "assume", "experimental.noalias", "emu_count_block")
# Functions that are the emulator itself, not kernel code.
_RUNTIME_FUNCTIONS = re.compile(
    r"simd\w*_at|barrier_at|3emu|emu_|_Function_handler|^(_ZNSt|_ZSt|_ZNKSt|__cxx|_GLOBAL__"
    r"|__clang|__gnu_)"
)
_SIZES = {"i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "half": 2, "float": 4, "double": 8}


@dataclass
class Counts:
    """Executed operations per class, summed over every thread of one or more launches."""

    ops: Counter = field(default_factory=Counter)
    launches: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.ops + other.ops, self.launches + other.launches)

    def per(self, units: float) -> dict[str, float]:
        """Each class divided by `units` (e.g. weights × tokens), every class present."""
        return {c: self.ops.get(c, 0) / units for c in CLASSES}


def _vector(ty: str) -> tuple[int, str]:
    m = re.match(r"<(\d+) x (\w+)>", ty)
    return (int(m.group(1)), m.group(2)) if m else (1, ty)


def _bytes(ty: str) -> int:
    n, elem = _vector(ty)
    return n * _SIZES.get(elem, 4)


def _addrspace(pointer_text: str) -> int:
    m = re.search(r"addrspace\((\d+)\)\*", pointer_text)
    return int(m.group(1)) if m else 0


def classify(line: str) -> Counter:
    """The operation classes of one IR instruction (empty for free ones)."""
    out: Counter = Counter()
    text = line.strip()
    body = text.split(" = ", 1)[1] if re.match(r"%[\w.]+ = ", text) else text
    op = body.split(" ", 1)[0]
    if op == "load":
        ty = re.match(r"load (?:volatile )?(<[^>]+>|[\w.%]+),", body)
        space = _addrspace(body)
        size = _bytes(ty.group(1)) if ty else 4
        key = {1: "device_read_bytes", 2: "device_read_bytes", 3: "threadgroup_bytes"}
        out[key.get(space, "private_bytes")] += size
    elif op == "store":
        ty = re.match(r"store (?:volatile )?(<[^>]+>|[\w.%]+) ", body)
        space = _addrspace(body)
        size = _bytes(ty.group(1)) if ty else 4
        key = {1: "device_write_bytes", 3: "threadgroup_bytes"}
        out[key.get(space, "private_bytes")] += size
    elif op in _DIVISIONS and re.search(r", (-?\d+)$", body.split(", !")[0]):
        # By a constant: compilers emit a shift (powers of two, with a sign fixup when signed) or
        # a multiply-high and a shift, never a divide.
        d = abs(int(re.search(r", (-?\d+)$", body.split(", !")[0]).group(1)))
        pow2 = d & (d - 1) == 0
        out["shift"] += 1
        out["int_add" if pow2 else "int_mul"] += 0 if pow2 and op[0] == "u" else 1
    elif op in _OPCODES:
        rest = body.split(" ", 1)[1]
        for flag in ("nuw", "nsw", "exact", "fast", "nnan", "ninf", "nsz", "arcp", "contract"):
            rest = re.sub(rf"^{flag} ", "", rest)
        if op in ("icmp", "fcmp"):
            rest = rest.split(" ", 1)[1]
        if op in ("sitofp", "uitofp", "fptosi", "fptoui", "fpext", "fptrunc"):
            ty = rest.split(" ", 1)[0] if not rest.startswith("<") else rest[: rest.index(">") + 1]
        elif op == "select":
            ty = re.search(r", (<[^>]+>|\w+) ", rest).group(1)
        else:
            ty = rest[: rest.index(">") + 1] if rest.startswith("<") else rest.split(" ", 1)[0]
        out[_OPCODES[op]] += _vector(ty)[0]
    elif op in ("call", "tail", "musttail", "notail"):
        m = re.search(r"@(\"[^\"]+\"|[\w.$]+)\(", body)
        name = m.group(1).strip('"') if m else ""
        if any(f in name for f in _FREE_CALLS):
            return out
        for key, cls in _RUNTIME_CALLS:
            if key in name:
                out[cls] += 1
                return out
        if name.startswith("llvm.memset") or name.startswith("llvm.memcpy"):
            size = re.search(r"i64 (\d+), i1", body)
            out["private_bytes"] += int(size.group(1)) if size else 0
            return out
        base = name[5:].split(".")[0] if name.startswith("llvm.") else name
        ty = re.match(r"(?:tail |musttail |notail )?call (?:\w+ )*?(<[^>]+>|\w+) ", body)
        lanes = _vector(ty.group(1))[0] if ty else 1
        if base in _CALLS:
            out[_CALLS[base]] += lanes
        else:
            out[f"call:{name}"] += 1
    return out


@dataclass
class Instrumented:
    ir: str
    blocks: list[Counter]


def instrument(ir: str) -> Instrumented:
    """Insert `emu_count_block(id)` at the top of every basic block of every kernel function
    (every defined function but the emulator's own) and classify each block's instructions."""
    out, blocks = [], []
    lines = ir.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"define [^@]*@(\"[^\"]+\"|[\w.$]+)\(", line)
        if not m or _RUNTIME_FUNCTIONS.search(m.group(1).strip('"')):
            out.append(line)
            i += 1
            continue
        out.append(line)
        i += 1
        start_block = True
        while i < len(lines) and lines[i] != "}":
            cur = lines[i]
            if re.match(r"^[\w.$\"-]+:", cur):
                out.append(cur)
                i += 1
                start_block = True
                continue
            if start_block and cur.strip() and not re.match(r"\s+%[\w.]+ = (phi|landingpad) ", cur):
                out.append(f"  call void @emu_count_block(i32 {len(blocks)})")
                blocks.append(Counter())
                start_block = False
            if cur.strip() and not start_block:
                blocks[-1].update(classify(cur))
            out.append(cur)
            i += 1
    return Instrumented("\n".join(out), blocks)


def compiler() -> str | None:
    """The clang++ that counting builds need, or None."""
    return shutil.which(clang())


def _count_tu(source: str) -> str:
    # clang rejects attribute lists on an explicit instantiation (Metal's [[host_name]]); the
    # kernel stays a function of its own, so its blocks are told apart from the launcher's.
    text = re.sub(r"template \[\[host_name\([^)]*\)\]\] \[\[kernel\]\]", "template", source)
    text = text.replace("[[kernel]] void", "[[kernel]] __attribute__((noinline)) void")
    return "#define EMU_COUNT 1\n" + emulate.translation_unit(source, text)


@cache
def _build(source: str) -> tuple[str, tuple[Counter, ...]]:
    clang = compiler()
    if clang is None:
        raise RuntimeError(
            f"operation counts need clang++ ({clang()!r} not found; set BITNEST_EMU_CLANG or "
            "install clang)"
        )
    tu = _count_tu(source)
    digest = hashlib.sha256((clang + tu).encode()).hexdigest()[:16]
    # Private to this process (the build directory is shared) and removed once loaded: the
    # counters live in the loaded library, which this process alone uses (`emulate.load` caches
    # it by path).
    base = emulate.build_dir() / f"count{digest}.{os.getpid()}"
    src, ll, lib = (Path(f"{base}{ext}") for ext in (".cpp", ".ll", ".so"))
    src.write_text(tu)
    flags = ["-std=c++17", "-fPIC", "-Wno-unknown-attributes", "-I", str(emulate.HERE)]
    try:
        _sh([clang, *flags, *OPT, "-S", "-emit-llvm", "-o", str(ll), str(src)])
        inst = instrument(ll.read_text())
        ll.write_text(inst.ir)
        _sh([clang, "-O1", "-shared", "-fPIC", "-Wno-override-module", "-o", str(lib), str(ll)])
        emulate.load(str(lib))
    finally:
        for f in (src, ll, lib):
            f.unlink(missing_ok=True)
    return str(lib), tuple(inst.blocks)


def _sh(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"counting build failed: {' '.join(cmd[:2])} ...\n{r.stderr[-4000:]}")


def count(launch: Launch, mutate: Callable[[str], str] | None = None) -> tuple[Counts, list]:
    """(executed operations, outputs) of one launch, run in a counting build."""
    source = emulate.generated(launch, mutate)
    path, blocks = _build(source)
    lib = emulate.load(path)
    lib.emu_read_counts.restype = ctypes.c_int
    lib.emu_read_counts(None, 0)  # reset: the library is shared by every run of this source
    outputs = emulate.execute(launch, source, lib)
    n = len(blocks)
    raw = (ctypes.c_uint64 * max(n, 1))()
    lib.emu_read_counts(raw, n)
    ops: Counter = Counter()
    for executed, block in zip(raw, blocks):
        if executed:
            for cls, k in block.items():
                ops[cls] += k * executed
    return Counts(ops, 1), outputs


class CountingRunner:
    """A `kernels.Runner` that executes every launch in a counting build and sums the counts,
    so a layer-level call with several launches is profiled as a whole."""

    def __init__(self, mutate: Callable[[str], str] | None = None):
        self.mutate = mutate
        self.counts = Counts()

    def __call__(self, launch: Launch) -> list[mx.array]:
        counts, outputs = count(launch, self.mutate)
        self.counts = self.counts + counts
        return outputs
