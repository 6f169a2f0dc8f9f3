"""`eval`'s text report: an `evaluation.evaluate` result (plus the CLI's model, text and mode) as
sections a person reads, each number once and named in words. `--json` prints the result itself
(docs/eval.md lists its fields)."""

from __future__ import annotations

from collections.abc import Mapping


def _header(r: Mapping) -> list[str]:
    return [
        f"eval of {r['model']} on {r['text']}: {r['tokens']} tokens scored, {r['bytes']} bytes",
        "perplexity (teacher-forced windows)",
        *(
            f"  {m:<8} ppl {s['ppl']:.4f}, {s['bits_per_byte']:.4f} bits/byte"
            for m, s in r["modes"].items()
        ),
    ]


def _draft(r: Mapping) -> list[str]:
    kv, sampling = r["draft_kv"], r["sampling"]
    limit = kv["kv8_context_limit"]
    lines = [
        f"draft against target (the draft reads KV{kv['windows']}: --draft-kv {kv['policy']}, "
        f"which reads KV8 up to {'any' if limit is None else limit} context tokens)",
        f"  greedy agreement      {r['argmax_agreement']:.2%}",
        f"  sum min(p, q)         {r['sum_min_pq']:.4f} (temp {sampling['temp']}, "
        f"top-p {sampling['top_p']})",
    ]
    full = r["full_vocab_draft"]
    if full["argmax_agreement"] != r["argmax_agreement"]:  # a reduced draft vocabulary
        lines.append(
            f"  draft vocabulary      {r['draft_vocab']} tokens; over every token the agreement "
            f"would be {full['argmax_agreement']:.2%}, sum min(p, q) {full['sum_min_pq']:.4f}"
        )
    if r["mean_accepted"] is not None:
        lines.append(
            f"  mean accepted         {r['mean_accepted']:.3f} drafts a round at gamma "
            f"{r['gamma']} (greedy)"
        )
    for name, s in kv["readings"].items():
        lines.append(
            f"  reading KV{name}:          ppl {s['ppl']:.4f}, greedy agreement "
            f"{s['argmax_agreement']:.2%}, sum min(p, q) {s['sum_min_pq']:.4f}"
        )
    return lines


def _fixed_runs(r: Mapping) -> list[str]:
    runs, sampling = r.get("speculative_sampling"), r["sampling"]
    if runs is None:
        return []
    lines = [
        f"speculative runs at a fixed gamma ({sampling['rule']} rule, seed {sampling['seed']}, "
        f"{runs['gen_tokens']} tokens on each of {', '.join(runs['prompt_tokens'])})"
    ]
    for g, s in runs["gammas"].items():
        lines.append(
            f"  gamma {g}: {s['tokens_per_round']:.3f} tokens a round ({s['mean_accepted']:.3f} "
            f"accepted + 1), acceptance {s['acceptance_rate']:.1%}, {s['rounds']} rounds"
        )
    return lines


def _speed(r: Mapping) -> list[str]:
    speed = r.get("speed_model")
    if speed is None:
        return []
    b, k = speed["bytes_per_token"], speed.get("kernels_per_token")
    launches = "" if k is None else f", {k['draft']:.0f} / {k['target']:.0f} kernels a token"
    lines = [
        f"projected speed-up by step time on {speed['chip']}, {speed['path']} path "
        f"({speed['context_tokens']} context tokens, draft KV{speed['draft_kv']}; draft / target "
        f"{b['draft'] / 1e6:.3f} / {b['target'] / 1e6:.3f} MB{launches}; bytes, kernels and "
        "syncs counted here, the constants fitted on an M4 Max: docs/step-time.md)"
    ]
    for g, s in speed["gammas"].items():
        measured = s["measured_speedup"]  # None without sampled runs (--gen-tokens 0)
        lines.append(
            f"  gamma {g}: "
            + (f"{measured:.3f}x from the runs, " if measured is not None else "")
            + f"{s['iid_speedup']:.3f}x i.i.d. at alpha {speed['alpha']:.3f}"
        )
    if speed["best_speedup"] is not None:
        lines.append(
            f"  best: gamma {speed['best_gamma']}, {speed['best_speedup']:.3f}x target-only "
            f"(i.i.d.: gamma {speed['best_gamma_iid']}, {speed['best_speedup_iid']:.3f}x)"
        )
    else:
        lines.append(
            f"  best (i.i.d.): gamma {speed['best_gamma_iid']}, "
            f"{speed['best_speedup_iid']:.3f}x target-only"
        )
    return lines


def _adaptive(r: Mapping) -> list[str]:
    a = (r.get("speculative_sampling") or {}).get("adaptive")
    if a is None:
        return []
    lines = [
        f"adaptive runs (--draft-source {a['draft_source']}, at most {a['num_draft_tokens']} W4 "
        f"tokens a round): {a['tokens_per_round']:.3f} tokens a round over {a['rounds']} rounds, "
        f"{a['target_steps']} of them target-only"
    ]
    for source, s in sorted(a["sources"].items()):
        lines.append(
            f"  {source}: {s['rounds']} rounds, {s['accepted']} of {s['drafted']} accepted"
        )
    for prompt, chips in a["projected_speedup"].items():
        lines.append(
            f"  {prompt}, projected: "
            + ", ".join(f"{c} {v['pure']:.3f}x / {v['kernel']:.3f}x" for c, v in chips.items())
            + " (pure / kernel path, step time)"
        )
    return lines


def _verify_cost(r: Mapping) -> list[str]:
    lines = []
    for path, chips in r["verify_cost"].items():
        ms = ", ".join(map(str, next(iter(chips.values()))))
        lines.append(f"verify cost v(M) of the {path} path at M = {ms}:")
        lines += [
            f"  {c:<9} " + " ".join(f"{v:.2f}" for v in row.values()) for c, row in chips.items()
        ]
    return lines


def report(r: Mapping) -> str:
    """The human-readable report of an eval result."""
    sections = (_header, _draft, _fixed_runs, _speed, _adaptive, _verify_cost)
    return "\n".join(line for section in sections for line in section(r))
