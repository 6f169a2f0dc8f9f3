"""The expert union of a DeepSeek-V4 verify pass, measured from a bundle's routing on real text.

A verify pass of M rows (the last token and M - 1 drafts) reads, in every MoE layer, the union
of the experts its M tokens route to. This script runs the workload prompts
(bitnest_mlx/workload_data) through a bundle, records every layer's routing (hash layers: the
token ids' tid2eid rows; learned layers: the gate's top-k of its hidden state) and averages the
distinct experts of every window of M consecutive tokens, M = 1..16. It also prints Flash's
share of routed-expert bytes in the weight bytes one token reads (its q3.4 bit plan, affine
8-bit elsewhere), the two numbers behind `speed_model.DSV4_FLASH`.

The commands behind docs/speculative.md ("DeepSeek-V4 bundles: n-gram drafts and the expert
union"); a synthetic bundle has random weights and no tokenizer, so the ids are the workload
text through Qwen2.5's tokenizer (ids past the bundle's vocabulary wrap around):

    python -m bitnest_mlx.dsv4 make-bundle --layers 3 --first-layer 2 --out /tmp/flash-l2-4
    python examples/dsv4_expert_union.py --bundle /tmp/flash-l2-4 \\
        --tokenizer ~/.cache/bitnest_mlx/realmodel/qwen2.5-coder-0.5b-instruct.gguf \\
        --prompts 4 --tokens 384 --json /tmp/flash-union.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from bitnest_mlx.models import deepseek_v4

from bitnest_mlx import load
from bitnest_mlx.formats.dsv4_synthetic import FLASH_CONFIG, _plans, synthetic_config
from bitnest_mlx.measurement.workloads import WORKLOADS, load_workload

MAX_M = 16


def text_ids(tokenizer_path: str, vocab: int, prompts: int, tokens: int) -> list[list[int]]:
    """The first `tokens` ids of the first `prompts` workload conversations that have as many
    (chat template applied), taken round-robin over the workloads; ids >= vocab wrap around."""
    from transformers import AutoTokenizer

    path = Path(tokenizer_path).expanduser()
    if path.suffix == ".gguf":
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tok = AutoTokenizer.from_pretrained(path)
    convs = [c for i in range(3) for w in WORKLOADS for c in load_workload(w)[i : i + 1]]
    out = []
    for conv in convs:
        text = tok.apply_chat_template(conv["messages"], add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) >= tokens:  # one batch: every text as long as the others
            out.append([i % vocab for i in ids[:tokens]])
    return out[:prompts]


class _Routed(Exception):
    """Raised by the last MoE layer's gate: its routing is all that is needed from it."""


def routing(model, texts: list[list[int]]) -> list[np.ndarray]:
    """Every MoE layer's routed experts [B, T, k] for the texts (cut to the shortest), in one
    batched prefill: each layer expands its experts once for all texts. The forward stops at
    the last layer's gate, whose experts' output nothing reads."""
    seen: dict[int, np.ndarray] = {}
    gates = {id(layer.ffn.gate): i for i, layer in enumerate(model.layers)}
    call = deepseek_v4.Gate.__call__

    def recording(self, x, tok, *options):
        idx, w = call(self, x, tok, *options)
        seen[gates[id(self)]] = np.array(idx)  # evaluates this layer and all before it
        if len(seen) == len(gates):
            raise _Routed
        return idx, w

    t = min(len(ids) for ids in texts)
    deepseek_v4.Gate.__call__ = recording
    try:
        model(mx.array([ids[:t] for ids in texts]))
    except _Routed:
        pass
    finally:
        deepseek_v4.Gate.__call__ = call
    return [seen[i] for i in sorted(seen)]


def window_union(idx: np.ndarray, n_experts: int, max_m: int = MAX_M) -> list[float]:
    """Mean distinct experts over every window of M consecutive tokens, M = 1..max_m."""
    hot = np.zeros((len(idx), n_experts), dtype=bool)
    np.put_along_axis(hot, idx.astype(np.int64), True, axis=1)
    cur, means = hot, []
    for m in range(1, max_m + 1):
        if m > 1:  # window [i, i + m) = window [i, i + m - 1) plus token i + m - 1
            cur = cur[:-1] | hot[m - 1 :]
        means.append(float(cur.sum(axis=1).mean()))
    return means


def flash_expert_share() -> dict:
    """Weight bytes one token reads in Flash (43 layers, the q3.4 plan): dense (every non-expert
    tensor, one row of the embedding and of tid2eid) and its top-k routed experts."""
    config = synthetic_config(FLASH_CONFIG["num_hidden_layers"], first_layer=0)
    n, k = config["n_routed_experts"], config["num_experts_per_tok"]
    dense = experts = 0
    for p in _plans(config, seed=0):  # shapes and dtypes only: no data is generated
        if ".switch_mlp." in p.key:
            experts += p.nbytes // n * k if p.shape[0] == n else 0
        elif p.key.startswith("embed.") or p.key.endswith(".tid2eid"):
            dense += p.nbytes // p.shape[0]
        else:
            dense += p.nbytes
    return {"dense_bytes": dense, "expert_bytes": experts, "share": experts / (dense + experts)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", required=True)
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory or a .gguf file")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=384, help="ids per prompt")
    p.add_argument("--max-expert-memory", type=float, default=1.0, help="GB of experts kept")
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args(argv)
    model, _ = load(args.bundle, max_expert_memory=args.max_expert_memory)
    a = model.args
    texts = text_ids(args.tokenizer, a.vocab_size, args.prompts, args.tokens)
    per_layer = routing(model, texts)  # [B, T, k] per layer
    tables = [union_over_prompts(list(r), a.n_routed_experts) for r in per_layer]
    config = json.loads((Path(args.bundle) / "config.json").read_text())
    k, e = a.num_experts_per_tok, a.n_routed_experts
    result = {
        "bundle": args.bundle,
        "flash_layers": config.get("synthetic", {}).get("flash_layers"),
        "hash_layers": a.num_hash_layers,
        "ids": [len(t) for t in texts],
        "ids_routed": int(per_layer[0].shape[1]),
        "union": {str(i): [round(u, 3) for u in t] for i, t in enumerate(tables)},
        "independent": [round(e * (1 - (1 - k / e) ** m), 3) for m in range(1, MAX_M + 1)],
        "flash_bytes_per_token": flash_expert_share(),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def union_over_prompts(routes: list[np.ndarray], n_experts: int) -> list[float]:
    """`window_union` of each prompt, averaged with weights = its windows at each M."""
    out = []
    tables = [(window_union(r, n_experts), len(r)) for r in routes]
    for m in range(1, MAX_M + 1):
        weights = [max(t - m + 1, 0) for _, t in tables]
        out.append(sum(u[m - 1] * w for (u, _), w in zip(tables, weights)) / sum(weights))
    return out


if __name__ == "__main__":
    main()
