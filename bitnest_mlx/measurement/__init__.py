"""Measurement: what bench and eval report (docs/architecture.md).

Bytes per token and tok/s ceilings (`roofline`), eval's acceptance and projected speed-ups
(`evaluation`), the built-in workloads (`workloads`, `bench_workloads`), bench's timing runs
(`bench_measure`), DeepSeek-V4 memory and per-part timing (`dsv4_bench`), kernel operation
counts against chip budgets (`kernel_costs`), `bench --speed-model` (`speed_projection`), and the
converter's one call into the runtime (`draft_vocab_score.score_draft_vocabulary`). Imports the
runtime and below; the CLI faces import it.
"""
