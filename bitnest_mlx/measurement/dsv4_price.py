"""DeepSeek-V4-Flash priced by the step-time model (issue 51, item 3; `bench --dsv4-price`).

    step = bytes / (f · bandwidth) + kernels · t_k + syncs · t_sync      (runtime/step_time.py)

* bytes: what one decode token reads, derived here from a config.json and its routed bit plan
  (by default the real DeepSeek-V4-Flash MLX q3.4 bundle's, shipped beside this module):
  every tensor of the schedule (`formats/dsv4_schedule.schedule`, the one list of names and
  shapes) at the precision the bundle stores and the model holds it, and the caches at a
  context: window rows, compressed entries, indexer keys, the compressors' raw rows;
* kernels: `step_kernels.STORED_DSV4` (the counter's kernels a layer and outside on the demo
  bundle, GPU basis) times the config's layers;
* syncs: one a token (every expert resident, decoding pipelined with `mx.async_eval`).

Nothing here is a byte total: change a field or a layer's bits in the config and the price
follows. What a token reads, and why:

* affine Linears (attention, compressors, indexer, shared experts, head): all of each matrix,
  `bits` per weight plus a float16 scale and bias per group (jang's layout, docs/mxtq.md; the
  model keeps them as stored); the embedding: one row, its scales widened to the model dtype;
* routed experts: `num_experts_per_tok` experts a layer, each projection's MXTQ codes at the
  plan's bits plus a float16 norm per output row; the codebook (2^bits float32) per projection
  and the rotation signs (float32) per input width, derived at load but read by every call;
* floats: whole, at float32 where the model does float32 math on them
  (`models.deepseek_v4_weights.float32_math`: `hc_*`, the router, the compressors' position
  bias and norm), else at the model dtype; of a position bias one row (t mod ratio) and of a
  hash layer's `tid2eid` one row (the token's);
* the indexer's query projection and head weights only when it scores: past `index_topk`
  compressed entries (the model skips it below, as mlx-lm and jang do: the top-k of at most k
  entries is all of them);
* caches at context T (the decoded token the T-th): min(T, sliding_window) K=V rows (one
  shared head, read once); ratio-128 layers every entry, T // 128; ratio-4 layers the top
  `index_topk` of T // 4 entries (`selected_only`; False: every visible entry, as the model's
  masked attention reads them today) and, when the indexer scores, all T // 4 indexer keys; the
  compressors' raw (kv, gate) rows, each read once when its block is pooled. Writes (a token's
  own K=V row, its raw rows) are left out: a few KB.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from ..formats import mxtq
from ..formats.dsv4_bundle import affine_params, bit_plan, plan_key, schedule
from ..formats.dsv4_config import DSV4Config
from ..models.deepseek_v4_weights import float32_math
from ..runtime.step_kernels import STORED_DSV4
from ..runtime.step_time import Step, StepConstants, breakdown, constants, provenance, step_seconds

FLASH_CONFIG_FILE = "dsv4f-mlx-tq-q3.4.config.json"  # the real bundle's config.json, verbatim
CONTEXTS = (2048, 65536)
CHIPS = ("M3 Max", "M4 Max", "M3 Ultra")
PATHS = ("kernel", "pure")
# Bytes of the model dtype on the GPU basis the kernels are counted on (float16). The loader
# holds a bundle in float32 unless told otherwise; `dtype_bytes=4` prices that.
DTYPE_BYTES = 2
SCALE_BYTES = 2  # an affine group's scale and bias: float16 as jang writes them, kept as stored
NORM_BYTES = 2  # an MXTQ row norm: float16 (`tq_norms`, docs/mxtq.md)
FLOAT32_BYTES = 4  # MXTQ codebooks and rotation signs (`formats/mxtq.py`), float32 math
INT_BYTES = 4  # tid2eid as the model holds it: int32
SYNCS_PER_TOKEN = 1.0  # every expert resident: the pipelined read of the sampled token
# Issue 51's acceptance: DeepSeek-V4-Flash at or above ds4 on an M3 Ultra at 2k context.
ACCEPTANCE = ("M3 Ultra", 2048, 44.0)

# Published decode speeds of DeepSeek-V4-Flash on Macs, beside which the projection is read
# (issue 51; jang: docs/mxtq.md's source, jang 2.5.50's METADATA). Context None: not stated.
ANCHORS = (
    ("ds4 (q2)", "M3 Ultra", 2048, 44.1, "ds4 issue #779"),
    ("ds4 (q2)", "M3 Ultra", 65536, 34.5, "ds4 issue #779"),
    ("ds4", "M4 Max", None, 35.0, "about 35 (issue 51)"),
    ("oMLX", "M3 Ultra", None, 29.0, "issue 51"),
    ("jang JANGTQ2", "M3 Ultra", None, 20.5, "jang 2.5.50 METADATA"),
)
# Weights by part, first match of the slot name wins (an indexer's compressor is the indexer's).
_PARTS = (
    ("indexer", ".attn.indexer."),
    ("compressor", ".attn.compressor."),
    ("shared_experts", ".ffn.shared_experts."),
    ("routed_experts", ".ffn.switch_mlp."),
    ("router", ".ffn.gate."),
    ("hyper_connections", "hc_"),
    ("norms", "norm.weight"),
    ("attention", ".attn."),
    ("head", "head"),
    ("embedding_row", "embed"),
)
WEIGHT_PARTS = (
    "attention",
    "compressor",
    "indexer",
    "shared_experts",
    "routed_experts",
    "mxtq_tables",
    "router",
    "hyper_connections",
    "norms",
    "head",
    "embedding_row",
)
CACHE_PARTS = ("window", "compressed_entries", "indexer_keys", "compressor_rows")


def flash_config() -> dict:
    """The real DeepSeek-V4-Flash MLX q3.4 bundle's config.json, bit plan included."""
    text = (resources.files(__package__) / FLASH_CONFIG_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def read_config(path: str | Path) -> dict:
    """A config.json, or the one in a bundle folder, validated as the bundle reader would."""
    path = Path(path)
    path = path / "config.json" if path.is_dir() else path
    config = json.loads(path.read_text(encoding="utf-8"))
    DSV4Config.from_dict(config, path)
    return config


def _part(name: str) -> str:
    return next(part for part, marker in _PARTS if marker in name)


def _indexer_scores(c: DSV4Config, context: int) -> bool:
    """The indexer scores once more than index_topk ratio-4 entries are visible."""
    return context // 4 > c.index_topk


def _expert_bits(config: dict, plan: dict[str, int], name: str) -> int:
    """The plan's bits for a routed slot, else the bundle's default routed bits."""
    bits = plan.get(plan_key(name), config.get("routed_expert_bits"))
    if bits is None:
        raise ValueError(f"{plan_key(name)}: no bits in routed_expert_bit_plan")
    return int(bits)


def weight_bytes(config: dict, context: int, dtype_bytes: int = DTYPE_BYTES) -> dict[str, float]:
    """Weight bytes one decode token reads at `context`, by part (WEIGHT_PARTS)."""
    c = DSV4Config.from_dict(config)
    plan, k = bit_plan(config), c.num_experts_per_tok
    out = dict.fromkeys(WEIGHT_PARTS, 0.0)
    widths: set[tuple[str, int]] = set()  # (layer, in_features) of each MXTQ rotation
    for name, slot in schedule(c).items():
        part, n = _part(name), math.prod(slot.shape)
        if slot.kind == "experts":
            _, rows, cols = slot.shape
            bits = _expert_bits(config, plan, name)
            mxtq.check_in_features(cols, bits)
            codes = rows * (cols // mxtq.values_per_word(bits)) * 4  # uint32 words
            out[part] += k * (codes + rows * NORM_BYTES)
            out["mxtq_tables"] += (1 << bits) * FLOAT32_BYTES  # the codebook
            widths.add((name.split(".")[1], cols))
        elif slot.kind in ("linear", "embedding"):
            rows, cols = slot.shape
            scoring = name.endswith((".indexer.wq_b", ".indexer.weights_proj"))
            if scoring and not _indexer_scores(c, context):
                continue  # the top-k of at most k entries: the indexer does not score
            bits, group = affine_params(config, name)  # the bundle reader's own rule
            scale = dtype_bytes if slot.kind == "embedding" else SCALE_BYTES
            row = cols * bits / 8 + 2 * (cols // group) * scale
            out[part] += row if slot.kind == "embedding" else rows * row
        elif slot.kind == "int":  # tid2eid: the token's row
            out[part] += slot.shape[1] * INT_BYTES
        else:
            size = FLOAT32_BYTES if float32_math(name) else dtype_bytes
            rows = slot.shape[0] if name.endswith(".ape") else 1  # a position bias: one row
            out[part] += n // rows * size
    out["mxtq_tables"] += sum(cols * FLOAT32_BYTES for _, cols in widths)  # rotation signs
    return out


def cache_bytes(
    config: dict, context: int, dtype_bytes: int = DTYPE_BYTES, selected_only: bool = True
) -> dict[str, float]:
    """Cache bytes one decode token reads at `context` tokens, by part (CACHE_PARTS)."""
    c = DSV4Config.from_dict(config)
    out = dict.fromkeys(CACHE_PARTS, 0.0)
    for ratio in c.compress_ratios:
        out["window"] += min(context, c.sliding_window) * c.head_dim * dtype_bytes
        if not ratio:
            continue
        entries = context // ratio
        if ratio == 4:
            scores = _indexer_scores(c, context)
            read = min(entries, c.index_topk) if selected_only else entries
            out["compressed_entries"] += read * c.head_dim * dtype_bytes
            out["indexer_keys"] += entries * c.index_head_dim * dtype_bytes if scores else 0
        else:
            out["compressed_entries"] += entries * c.head_dim * dtype_bytes
        # Raw kv and gate rows (twice the head at ratio 4: the overlap's two halves), each read
        # once when its block is pooled: one row of each a token, amortized.
        widths = [c.head_dim] + ([c.index_head_dim] if ratio == 4 else [])
        coff = 2 if ratio == 4 else 1
        out["compressor_rows"] += sum(2 * coff * w * dtype_bytes for w in widths)
    return out


def token_bytes(
    config: dict, context: int, dtype_bytes: int = DTYPE_BYTES, selected_only: bool = True
) -> dict:
    """{"weights": by part, "cache": by part, "total": bytes} of one decode token."""
    w = weight_bytes(config, context, dtype_bytes)
    kv = cache_bytes(config, context, dtype_bytes, selected_only)
    return {"weights": w, "cache": kv, "total": sum(w.values()) + sum(kv.values())}


def kernels_per_token(config: dict, path: str) -> float:
    """The stored demo-bundle kernels a layer and outside (`STORED_DSV4`) at the config's layers."""
    return STORED_DSV4[path].per_token(DSV4Config.from_dict(config).num_hidden_layers)


def flash_step(
    config: dict,
    context: int,
    path: str,
    dtype_bytes: int = DTYPE_BYTES,
    selected_only: bool = True,
) -> Step:
    """The decode step the projection prices: bytes at `context`, `path`'s kernels, one sync."""
    nbytes = token_bytes(config, context, dtype_bytes, selected_only)["total"]
    return Step(nbytes, kernels_per_token(config, path), SYNCS_PER_TOKEN)


def priced(step: Step, chip: str | StepConstants) -> dict:
    """The step's terms (ms), tok/s and what bounds it (its largest term) on `chip`."""
    terms = breakdown(step, chip)
    bound = max(("bytes", "kernels", "syncs"), key=lambda t: terms[f"{t}_ms"])
    return {"kernels": step.kernels, "syncs": step.syncs, **terms, "bound": bound}


def anchors_for(chip: str, context: int) -> list[dict]:
    """Published figures on `chip` at `context` (or at an unstated context)."""
    return [
        {"who": who, "tokens_per_second": tps, "context": ctx, "source": src}
        for who, at, ctx, tps, src in ANCHORS
        if at == chip and ctx in (context, None)
    ]


def step_row(config: dict, chip: str | StepConstants, context: int, path: str) -> dict:
    """The decode step at `context` on `path`: its GB, then its terms, tok/s and bound on
    `chip` (a chip's constants, or constants measured elsewhere: the doctor's)."""
    step = flash_step(config, context, path)
    return {"context": context, "path": path, "gb": step.nbytes / 1e9, **priced(step, chip)}


def row(config: dict, chip: str, context: int, path: str) -> dict:
    """One projection: `step_row` on `chip`, beside the anchors and the tok/s if every visible
    ratio-4 entry were read (the model's masked attention today)."""
    every = flash_step(config, context, path, selected_only=False)
    return {
        "chip": chip,
        **step_row(config, chip, context, path),
        "tokens_per_second_every_entry": 1 / step_seconds(every, chip),
        "anchors": anchors_for(chip, context),
    }


def chip_constants(chip: str) -> dict:
    """`chip`'s step-time constants and where they come from (`step_time.provenance`)."""
    k = constants(chip)
    return {
        "bandwidth_gbs": k.bandwidth_gbs,
        "f": k.f,
        "t_kernel_us": k.t_kernel * 1e6,
        "t_sync_us": k.t_sync * 1e6,
        "provenance": provenance(chip),
    }


def price(
    config: dict | None = None,
    contexts: Sequence[int] = CONTEXTS,
    chips: Sequence[str] = CHIPS,
    source: str = FLASH_CONFIG_FILE,
) -> dict:
    """The whole projection: bytes by part at each context, then on each chip, context and path
    the step's terms, tok/s and bound beside the published anchors (and, for comparison, the
    tok/s if every visible ratio-4 entry were read); the constants and their provenance."""
    config = flash_config() if config is None else config
    c = DSV4Config.from_dict(config)
    rows = [row(config, chip, t, path) for chip in chips for t in contexts for path in PATHS]
    chip, t, goal = ACCEPTANCE
    got = next(r for r in rows if (r["chip"], r["context"], r["path"]) == (chip, t, "kernel"))
    return {
        "model": config.get("_name_or_path", "DeepSeek-V4"),
        "config": source,
        "layers": c.num_hidden_layers,
        "top_k": c.num_experts_per_tok,
        "index_topk": c.index_topk,
        "dtype_bytes": DTYPE_BYTES,
        "syncs_per_token": SYNCS_PER_TOKEN,
        "kernels_per_token": {p: kernels_per_token(config, p) for p in PATHS},
        "kernels_per_layer": {p: STORED_DSV4[p].per_layer for p in PATHS},
        "kernels_outside": {p: STORED_DSV4[p].outside for p in PATHS},
        "bytes": {str(t): token_bytes(config, t) for t in contexts},
        "bytes_every_entry": {
            str(t): token_bytes(config, t, selected_only=False)["total"] for t in contexts
        },
        "constants": {chip: chip_constants(chip) for chip in chips},
        "rows": rows,
        "acceptance": {
            "chip": chip,
            "context": t,
            "path": "kernel",
            "goal_tokens_per_second": goal,
            "projected_tokens_per_second": got["tokens_per_second"],
            "met": got["tokens_per_second"] >= goal,
            "bound": got["bound"],
        },
    }


def _ctx(t: int) -> str:
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


def _published(anchors: list[dict]) -> str:
    return ", ".join(
        f"{a['who']} {a['tokens_per_second']:g}" + ("" if a["context"] else " (context not stated)")
        for a in anchors
    )


def report(r: dict) -> str:
    """`bench --dsv4-price`'s text: bytes by part, the step on each chip, the anchors."""
    ts = list(r["bytes"])
    lines = [
        f"{r['model']} priced by step time ({r['config']}; {r['layers']} layers, "
        f"top-{r['top_k']} experts, float{8 * r['dtype_bytes']} caches)",
        "",
        f"| MB a decode token | {' | '.join(_ctx(int(t)) for t in ts)} |",
        "|---|" + "---|" * len(ts),
    ]
    for group in ("weights", "cache"):
        for part in r["bytes"][ts[0]][group]:
            cells = " | ".join(f"{r['bytes'][t][group][part] / 1e6:.1f}" for t in ts)
            lines.append(f"| {group}: {part.replace('_', ' ')} | {cells} |")
    cells = " | ".join(f"**{r['bytes'][t]['total'] / 1e6:.1f}**" for t in ts)
    every = " | ".join(f"{r['bytes_every_entry'][t] / 1e6:.1f}" for t in ts)
    lines += [f"| total | {cells} |", f"| total, every ratio-4 entry read | {every} |", ""]
    k, per, out = r["kernels_per_token"], r["kernels_per_layer"], r["kernels_outside"]
    paths = [f"{p} {per[p]:.1f} x {r['layers']} + {out[p]:g} = {k[p]:.0f}" for p in k]
    lines += [
        f"kernels a token: {', '.join(paths)}; host syncs a token: {r['syncs_per_token']:g}",
        "",
        "| chip | context | path | GB | bytes ms | kernels ms | syncs ms | tok/s | bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['chip']} | {_ctx(row['context'])} | {row['path']} | {row['gb']:.3f} | "
            f"{row['bytes_ms']:.2f} | {row['kernels_ms']:.2f} | {row['syncs_ms']:.2f} | "
            f"{row['tokens_per_second']:.1f} | {row['bound']} |"
        )
    lines += [
        "",
        "| chip | context | kernel path | pure path | published |",
        "|---|---|---|---|---|",
    ]
    for kernel, pure in zip(r["rows"][::2], r["rows"][1::2]):
        lines.append(
            f"| {kernel['chip']} | {_ctx(kernel['context'])} | "
            f"{kernel['tokens_per_second']:.1f} | {pure['tokens_per_second']:.1f} | "
            f"{_published(kernel['anchors']) or '—'} |"
        )
    last = [row for row in r["rows"][::2] if row["context"] == int(ts[-1])]
    every = ", ".join(f"{row['chip']} {row['tokens_per_second_every_entry']:.1f}" for row in last)
    a = r["acceptance"]
    lines += [
        "",
        f"kernel path at {_ctx(int(ts[-1]))} reading every visible ratio-4 entry (the model's "
        f"masked attention today) instead of the top {r['index_topk']}: {every} tok/s",
        f"issue 51: {a['chip']} at {_ctx(a['context'])}, {a['path']} path: "
        f"{a['projected_tokens_per_second']:.1f} tok/s against >= {a['goal_tokens_per_second']:g}"
        f": {'met' if a['met'] else 'not met'} (bound by {a['bound']})",
    ]
    for chip, c in r["constants"].items():
        lines.append(
            f"{chip}: {c['bandwidth_gbs']:g} GB/s, f {c['f']}, t_k {c['t_kernel_us']:.2f} us, "
            f"t_sync {c['t_sync_us']:.0f} us: {c['provenance']}"
        )
    return "\n".join(lines)
