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
from dataclasses import dataclass
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
from .package import layer_names, stored_embedding, stored_head, stored_layer
from .resume import Partial
from .rotation import Rotation
from .settings import BuildSettings
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


RTN = BuildSettings()  # the default: rounding to nearest, no rotation, no calibration


@dataclass(frozen=True)
class Built:
    """What `build` wrote: the package's folder and each Linear's diagnostics."""

    path: Path
    per_linear: dict[str, dict]


def build(
    out_dir: str | Path,
    source,
    settings: BuildSettings = RTN,
    *,
    stages: Stages | None = None,
    progress: bool = False,
    resume: Partial | None = None,
    shard_bytes: int = 2 * 2**30,
) -> Built:
    """Write `source` (a `sources.Source`) as a package in `out_dir`, as `settings` say (no
    method and no `quantize`: RTN).

    `resume` (the partial folder `out_dir` is, `resume.py`) records each finished layer and
    continues after those it already holds: their tensors, diagnostics and the calibration's
    hidden states come from its record, and they are not computed again."""
    own_stages = Stages() if stages is None else None
    run = _Build(source, settings, stages or own_stages, progress)
    try:
        run.open(out_dir, resume, shard_bytes)
        for i in range(run.start, source.config["num_hidden_layers"]):
            run.layer(i)
        return Built(run.finish(), run.stats)
    finally:
        run.close()
        if own_stages is not None:
            own_stages.close()


class _Build:
    """One build's state, shared by its steps: the writer, the calibration, the quantizing
    workers, the progress bar and the per-Linear diagnostics gathered so far."""

    def __init__(self, source, settings: BuildSettings, stages: Stages, progress: bool):
        self.source, self.settings, self.stages, self.progress = source, settings, stages, progress
        self.stats: dict[str, dict] = {}
        self.pool: LinearPool | None = None
        self.bar = None

    def open(self, out_dir: str | Path, resume: Partial | None, shard_bytes: int) -> None:
        """Checks the source, then starts the writer, the calibration (at the first layer to
        write), the workers and the bar."""
        s, config = self.settings, self.source.config  # completed by the source: head_dim, ...
        self.group = _check_source(self.source, config, s.group_size)
        if s.method.calibrated and s.quantize is None and s.tokens is None:
            raise ValueError(f"method {s.method.name} needs calibration tokens")
        k = split_k(config["intermediate_size"])
        self.had = hadamard_k(k) if k > 1 else None
        self.writer = self._writer(out_dir, resume, shard_bytes)
        self.resume = resume
        self.start = 0 if resume is None else resume.layers_done
        calibrated = s.tokens is not None and s.method.calibrated and s.quantize is None
        calibration = (s.tokens if calibrated else None, self.had, s.smoothing)
        self.calib = _start(self.writer, self.source, s.rotation, self.stages, resume, calibration)
        self.stats.update(resume.per_linear if self.start else {})
        self.pool = LinearPool(s.method, self.group, None if s.quantize is None else 1)
        self.bar = tqdm(
            total=config["num_hidden_layers"] + 1,
            initial=self.start,
            desc=f"{s.method.name} {self.source.name}",
            unit="layer",
            disable=not self.progress,
        )

    def _writer(self, out_dir: str | Path, resume: Partial | None, shard_bytes: int):
        s, source, config = self.settings, self.source, self.source.config
        available = set(source.names())
        return PackageWriter(
            out_dir,
            config,
            biased={lin for lin in linear_shapes(config) if f"{lin}.bias" in available},
            had_k=self.had,
            group_size=self.group,
            tokenizer_dir=source.tokenizer_dir,
            name=s.name or source.name,
            source_model=s.source_model,
            r3=s.r3,
            kv_group=s.kv_group,
            norms=None if s.smoothing is None else dict(s.smoothing),
            shard_bytes=shard_bytes,
            segment_dir=None if resume is None else resume.folder,
        )

    def layer(self, i: int) -> None:
        """Decoder layer i: read, calibrate, quantize, write, move the calibration on, record."""
        p, s, stages = f"model.layers.{i}.", self.settings, self.stages
        with stages("read"):
            w = stored_layer(self.source, i, s.rotation, s.smoothing, self.had)
        hessians = {}
        if self.calib is not None:
            with stages("calibrate"):
                hessians = self.calib.hessians(i, w)
        planes, chosen = {}, self._choose_layer(p, w, hessians)
        for lin in LAYER_LINEARS:
            planes[lin] = self._record(p + lin, *chosen[lin])
            with stages("write"):
                self.writer.add_linear(p + lin, planes[lin], w.get(f"{lin}.bias"))
        del hessians, chosen
        if self.calib is not None:
            with stages("calibrate"):
                self.calib.advance(i, planes, w)
        del w, planes
        if self.resume is not None:  # layer i is on the disk, and where the next one starts
            with stages("write"):
                hidden = None if self.calib is None else self.calib.h
                self.resume.save_layer(i + 1, self.writer.checkpoint(), self.stats, hidden)
        self.bar.update()

    def finish(self) -> Path:
        """lm_head, then the manifest; returns the package's folder."""
        self.pool.close()  # lm_head is one task: the workers' memory is better spent on it
        s, stages = self.settings, self.stages
        with stages("read"):
            head = stored_head(self.source, s.rotation, s.smoothing)
        h = None
        if self.calib is not None:
            with stages("calibrate"):
                h = self.calib.final_hessian()
                self.calib = None  # its hidden states, before lm_head's planes
        with stages("quantize"):
            planes = self._record("lm_head", *self._choose_here("lm_head", head, h))
        del head, h
        with stages("write"):
            self.writer.add_linear("lm_head", planes)
            self.bar.update()
            self.bar.close()
            return self.writer.finish(self._notes())

    def _notes(self) -> dict | None:
        s = self.settings
        if not s.diagnostics:
            return s.notes
        # Up to here: the checksum pass over the shards is not in the resources.
        return {**(s.notes or {}), "per_linear": self.stats, "resources": self.stages.report()}

    def _record(self, lin: str, planes: Planes, errors: dict) -> Planes:
        self.stats[lin] = {
            **{key: round(v, 4) for key, v in errors.items()},
            "saturation": round(planes.saturation, 6),
            "w8_max_rel_err": float(f"{planes.w8_max_rel_err:.3e}"),
            "w4_rel_fro_err": round(planes.w4_rel_fro_err, 5),
        }
        if "w4_hessian_err_vs_rtn" in errors and self.progress:
            e = errors
            tqdm.write(
                f"{lin}: output error vs RTN: W4 {e['w4_hessian_err_vs_rtn']:.3f}x, "
                f"W8 {e['w8_hessian_err_vs_rtn']:.3f}x"
                + (f" (lambda {e['lambda_draft']:.3g})" if "lambda_draft" in e else ""),
                file=sys.stderr,
            )
        return planes

    def _choose_here(self, name: str, w: np.ndarray, h: np.ndarray | None) -> tuple[Planes, dict]:
        """One Linear's planes in this process: the callback's, else the method's."""
        if self.settings.quantize is not None:
            return self.settings.quantize(name, w), {}
        return self.settings.method.quantize(w, h, self.group, {})

    def _choose_layer(
        self, prefix: str, w: Mapping[str, np.ndarray], hessians: Mapping[str, np.ndarray]
    ) -> dict[str, tuple[Planes, dict]]:
        weights = {lin: w[f"{lin}.weight"] for lin in LAYER_LINEARS}
        with self.stages("quantize"):
            if self.settings.quantize is not None:
                return {lin: self._choose_here(prefix + lin, x, None) for lin, x in weights.items()}
            return self.pool.quantize_layer(weights, hessians)

    def close(self) -> None:
        if self.bar is not None:  # ends its line: an error's message starts on a line of its own
            self.bar.close()
        if self.pool is not None:
            self.pool.close()


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
    settings = BuildSettings(
        quantize=quantize,
        name=name,
        source_model=source_model,
        notes=notes,
        r3=r3,
        kv_group=kv_group,
        smoothing=smoothing,
        group_size=group_size,
    )
    return build(out_dir, source, settings).path
