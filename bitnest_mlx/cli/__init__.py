"""The command-line faces. Each module has `main(argv) -> exit code`; `python -m bitnest_mlx.<name>`
and the console scripts `bitnest-<name>` both run it."""

COMMANDS = {
    "generate": "stream text from a package or bundle (default: the offline demo package)",
    "chat": "a multi-turn chat on the model's chat template (/reset, /exit)",
    "convert": "HF safetensors or GGUF (Llama, Qwen2) -> bitnest package",
    "eval": "perplexity, bits/byte and draft/target agreement on a text file",
    "bench": "draft, target and speculative tok/s beside mlx-lm on the same backend",
    "server": "mlx-lm's OpenAI-compatible server with self-speculation",
    "upload": "publish a package or bundle to the Hugging Face Hub with a model card",
    "verify": "check a package or bundle against the sha256 checksums its writer recorded",
    "doctor": "a report to paste into an issue: this machine, each kernel's self-test and GB/s",
}
