"""The runtime: a package or bundle in, tokens out (docs/architecture.md).

Loading (`loader`: the format registry, detect -> model + tokenizer; `dsv4`: its DeepSeek-V4
entry; `demo`: the shipped demos), generation (`speculative`: the speculative loop and its
controller `draft_control`, n-gram drafts `prompt_lookup`, `draftless` for models with no draft
plane; `sampling`: distributions and the accept rule) and the costs the loop plans with
(`token_bytes`: bytes per token; `draft_kv`: KV4 or KV8 for the draft; `speed_model`: v(M) and
what a round costs, on `chips`' facts). Imports formats, kernels, layers, models and the
converter's output helpers; never measurement, the mlx-lm integration or the CLI.
"""
