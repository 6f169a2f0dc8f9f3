"""The converter's one pipeline, a layer at a time: read a layer's float weights from the source,
fold / rotate / smooth / fuse R4 (`package.py`), calibrate it through the runtime's forward
(`calibrate.py`), choose its planes (`methods.py`), hand them to the streaming writer, and move
the calibration's hidden states through the quantized layer. Memory holds one layer's float
weights, the embedding (bf16), the calibration state and one shard of planes; lm_head is read
last.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..formats.bitnest import (
    LAYER_LINEARS,
    WEIGHT_GROUPS,
    PackageError,
    Planes,
    choose_group_size,
    linear_shapes,
)
from ..formats.bitnest.writer import PackageWriter
from ..formats.hadamard import hadamard_k, split_k
from .calibrate import Calibration
from .methods import Method
from .package import layer_names, stored_embedding, stored_head, stored_layer
from .resume import Partial
from .rotation import Rotation
from .sources import Source
from .stages import Stages
from .workers import LinearPool

# Quantizes one Linear: (full name, stored float weight [N, K], input Hessian or None)
# -> (planes, per-Linear diagnostics for the manifest).
Quantizer = Callable[[str, np.ndarray, np.ndarray | None], tuple[Planes, dict]]


def _check_source(source, config: dict, group_size: int | None) -> int:
    """Every tensor present and shaped as the config implies (from the source's headers, without
    reading the data) before anything is written; returns the weight group size."""
    available = set(source.names())
    n = config["num_hidden_layers"]
    required = [name for i in range(n) for name in layer_names(i)]
    required += ["model.embed_tokens.weight", "model.norm.weight"]
    missing = [name for name in required if name not in available]
    if missing:
        raise PackageError(f"write: missing float weight {missing[0]} (expected HF tensor names)")
    shapes = linear_shapes(config)
    head = "lm_head.weight" if "lm_head.weight" in available else "model.embed_tokens.weight"
    expected = {head if lin == "lm_head" else f"{lin}.weight": s for lin, s in shapes.items()}
    expected.setdefault("model.embed_tokens.weight", (config["vocab_size"], config["hidden_size"]))
    for wname, shape in expected.items():
        got = list(source.shape(wname))
        if got != list(shape):
            raise PackageError(f"write: {wname} has shape {got}; the config implies {list(shape)}")
    try:
        group = choose_group_size({s[1] for s in shapes.values()}, group_size)
    except ValueError:
        allowed = WEIGHT_GROUPS if group_size is None else (group_size,)
        lin, shape = next((lin, s) for lin, s in shapes.items() if all(s[1] % g for g in allowed))
        raise PackageError(
            f"write: {head if lin == 'lm_head' else lin + '.weight'} has shape {list(shape)}; "
            f"expected K (the last dim) to be a multiple of "
            f"{' or '.join(map(str, allowed))}"
        ) from None
    try:
        split_k(config["intermediate_size"])
    except ValueError as e:
        raise PackageError(f"write: {e}") from e
    return group


def build(
    out_dir: str | Path,
    source,
    *,
    method: Method | None = None,
    quantize: Callable[[str, np.ndarray], Planes] | None = None,
    rotation: Rotation | None = None,
    tokens: np.ndarray | None = None,
    smoothing: Mapping[str, np.ndarray] | None = None,
    group_size: int | None = None,
    name: str | None = None,
    source_model: str | None = None,
    notes: dict | Callable[[], dict] | None = None,
    r3: bool = False,
    kv_group: int | None = None,
    stages: Stages | None = None,
    progress: bool = False,
    per_linear: dict[str, dict] | None = None,
    shard_bytes: int = 2 * 2**30,
    resume: Partial | None = None,
) -> Path:
    """Write `source` (a `sources.Source`) as a package in `out_dir`.

    `method` chooses the planes (calibrated methods need `tokens` [n_seq, seq_len]); a
    `quantize(name, w)` callback overrides it (no calibration); neither: RTN. `smoothing` is the
    norms' vectors (already chosen). `per_linear` (a dict) receives each Linear's diagnostics.
    `notes` is the manifest's `conversion` block, or a function giving it once every Linear is
    quantized (so it can hold the diagnostics and the stages' resources).

    `resume` (the partial folder `out_dir` is, `resume.py`) records each finished layer and
    continues after those it already holds: their tensors, diagnostics and the calibration's
    hidden states come from its record, and they are not computed again."""
    own_stages = Stages() if stages is None else None
    stages = stages or own_stages
    pool: LinearPool | None = None
    bar = None
    try:
        config = source.config  # completed by the source: head_dim, kv heads, RoPE
        group = _check_source(source, config, group_size)
        method = method or Method("rtn")
        if method.calibrated and quantize is None and tokens is None:
            raise ValueError(f"method {method.name} needs calibration tokens")
        n_layers = config["num_hidden_layers"]
        shapes = linear_shapes(config)
        available = set(source.names())
        k = split_k(config["intermediate_size"])
        had = hadamard_k(k) if k > 1 else None
        biased = {lin for lin in shapes if f"{lin}.bias" in available}
        stats = {} if per_linear is None else per_linear

        def record(lin: str, planes: Planes, errors: dict) -> Planes:
            stats[lin] = {
                **{key: round(v, 4) for key, v in errors.items()},
                "saturation": round(planes.saturation, 6),
                "w8_max_rel_err": float(f"{planes.w8_max_rel_err:.3e}"),
                "w4_rel_fro_err": round(planes.w4_rel_fro_err, 5),
            }
            if "w4_hessian_err_vs_rtn" in errors and progress:
                e = errors
                tqdm.write(
                    f"{lin}: output error vs RTN: W4 {e['w4_hessian_err_vs_rtn']:.3f}x, "
                    f"W8 {e['w8_hessian_err_vs_rtn']:.3f}x"
                    + (f" (lambda {e['lambda_draft']:.3g})" if "lambda_draft" in e else ""),
                    file=sys.stderr,
                )
            return planes

        def choose_here(name: str, w: np.ndarray, h: np.ndarray | None) -> tuple[Planes, dict]:
            """One Linear's planes in this process: the callback's, else the method's."""
            if quantize is not None:
                return quantize(name, w), {}
            return method.quantize(w, h, group, {})

        def choose_layer(
            prefix: str, w: Mapping[str, np.ndarray], hessians: Mapping[str, np.ndarray]
        ) -> dict[str, tuple[Planes, dict]]:
            weights = {lin: w[f"{lin}.weight"] for lin in LAYER_LINEARS}
            with stages("quantize"):
                if quantize is not None:
                    return {lin: choose_here(prefix + lin, x, None) for lin, x in weights.items()}
                return pool.quantize_layer(weights, hessians)

        writer = PackageWriter(
            out_dir,
            config,
            biased=biased,
            had_k=had,
            group_size=group,
            tokenizer_dir=source.tokenizer_dir,
            name=name or source.name,
            source_model=source_model,
            r3=r3,
            kv_group=kv_group,
            norms=None if smoothing is None else dict(smoothing),
            shard_bytes=shard_bytes,
            segment_dir=None if resume is None else resume.folder,
        )
        start = 0 if resume is None else resume.layers_done
        calibrated = tokens is not None and method.calibrated and quantize is None
        calibration = (tokens if calibrated else None, had, smoothing)
        calib = _start(writer, source, rotation, stages, resume, calibration)
        stats.update(resume.per_linear if start else {})
        pool = LinearPool(method, group, None if quantize is None else 1)

        bar = tqdm(
            total=n_layers + 1,
            initial=start,
            desc=f"{method.name} {source.name}",
            unit="layer",
            disable=not progress,
        )
        for i in range(start, n_layers):
            p = f"model.layers.{i}."
            with stages("read"):
                w = stored_layer(source, i, rotation, smoothing, had)
            hessians = {}
            if calib is not None:
                with stages("calibrate"):
                    hessians = calib.hessians(i, w)
            planes, chosen = {}, choose_layer(p, w, hessians)
            for lin in LAYER_LINEARS:
                planes[lin] = record(p + lin, *chosen[lin])
                with stages("write"):
                    writer.add_linear(p + lin, planes[lin], w.get(f"{lin}.bias"))
            del hessians, chosen
            if calib is not None:
                with stages("calibrate"):
                    calib.advance(i, planes, w)
            del w, planes
            if resume is not None:  # layer i is on the disk, and where the next one starts
                with stages("write"):
                    hidden = None if calib is None else calib.h
                    resume.save_layer(i + 1, writer.checkpoint(), stats, hidden)
            bar.update()

        pool.close()  # lm_head is one task: the workers' memory is better spent on it
        with stages("read"):
            head = stored_head(source, rotation, smoothing)
        h = None
        if calib is not None:
            with stages("calibrate"):
                h = calib.final_hessian()
                del calib
        with stages("quantize"):
            planes = record("lm_head", *choose_here("lm_head", head, h))
        del head, h
        with stages("write"):
            writer.add_linear("lm_head", planes)
            bar.update()
            bar.close()
            return writer.finish(notes() if callable(notes) else notes)
    finally:
        if bar is not None:  # ends its line: an error's message starts on a line of its own
            bar.close()
        if pool is not None:
            pool.close()
        if own_stages is not None:
            own_stages.close()


def _start(
    writer: PackageWriter,
    source,
    rotation: Rotation | None,
    stages: Stages,
    resume: Partial | None,
    calibration: tuple,
) -> Calibration | None:
    """The embedding given to `writer` and the calibration at the first layer; or, resuming
    after finished layers, the writer restored and the calibration on the saved hidden states
    (the embedding is in a saved segment already). `calibration` is Calibration's (tokens or
    None for none, R4's had_k, the smoothing vectors)."""
    tokens, had, smoothing = calibration
    if resume is not None and resume.layers_done:
        writer.restore(resume.writer_state)
        if tokens is None:
            return None
        with stages("calibrate"):
            return Calibration.resumed(writer.spec, resume.hidden(), had, smoothing)
    with stages("read"):
        embed_f32 = stored_embedding(source, rotation)
        embed = mx.array(embed_f32).astype(mx.bfloat16)
        mx.eval(embed)
        del embed_f32
    with stages("write"):
        writer.add("model.embed_tokens.weight", embed)
    if tokens is None:
        return None
    with stages("calibrate"):
        return Calibration(writer.spec, embed, tokens, had, smoothing)


def write_package(
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
    smoothing: Mapping[str, np.ndarray] | None = None,
    group_size: int | None = None,
) -> Path:
    """Write float Llama/Qwen2 weights (HF names) as a package: norms folded, R4 fused, RTN
    (no rotation, no calibration; `convert.convert` does those), through the converter's own
    streaming pipeline.

    `smoothing` ({norm weight name: d [D] > 0}) stores d as those norm weights and divides the
    columns of the Linears reading them by d after folding (`smooth_linears`): the package says
    `norms.smoothing: true` (§2.5). `quantize(name, w)` replaces RTN (e.g. GPTQ hi codes via
    `planes_from_codes`); it is called once per Linear in forward order (layer 0 q, k, v, o,
    gate, up, down, layer 1, ..., lm_head) with the weight as stored (norms folded, R4 fused).
    """
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else None
    source = Source.from_arrays(weights, config, tok, name or Path(out_dir).name)
    return build(
        out_dir,
        source,
        quantize=quantize,
        name=name,
        source_model=source_model,
        notes=notes,
        r3=r3,
        kv_group=kv_group,
        smoothing=smoothing,
        group_size=group_size,
    )
