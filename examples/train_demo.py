"""Train the demo model (`--model demo`) from scratch and convert it into the package.

A small Llama (mlx-lm's architecture, float32, seeded) learns the English of the software
licenses Debian ships in /usr/share/common-licenses (GPL, LGPL, GFDL, Apache, MPL, BSD, CC0);
the Artistic License is held out for the perplexity quoted in docs/eval.md. A byte-level BPE
tokenizer is trained on the same text. The float checkpoint is written in Hugging Face layout
and converted with the project's converter (the default joint W4/W8 codes, calibrated on the
training text) into bitnest_mlx/demo_model, which ships with the package.

    python examples/train_demo.py --keep-float /tmp/demo-hf   # train, checkpoint, convert
    python examples/train_demo.py --keep-float /tmp/demo-hf --convert-only   # convert as it is
    python examples/train_demo.py --steps 6 --out /tmp/demo   # a smoke run of the whole path

The cost is about 6 x 1.25 M x 512 = 3.8 GFLOP per default step (batch 4 x 128 tokens), so
1,200 steps are ~4.6 TFLOP on the CPU (one backend, so one rounding): minutes on an idle
multi-core CPU, hours on a shared one (a 16 x 128-token step took 6.6 s on this project's 2-core
CPU at nice 19 while other jobs ran).

Same seed, same corpus and same MLX version give the same weights on the same backend; the
shipped package is the reference (CPU and Metal round differently).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama

LICENSES = Path("/usr/share/common-licenses")
HELD_OUT = "Artistic"  # never trained on: docs/eval.md's perplexity text
EOS = "<|endoftext|>"
# The demo never saw a conversation: its chat template lays the turns out as plain text, the form
# of its training corpus (Debian's license texts), a reply continuing the user's text and a blank
# line after each reply (and after the system message). So the model continues what it is given,
# which is all it can do. It exists so that chat, the server's chat endpoint and --system-prompt
# behave.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['content'] }}"
    "{%- if message['role'] != 'user' -%}{{ '\\n\\n' }}{%- endif -%}"
    "{%- endfor -%}"
)
SHIPPED = Path(__file__).resolve().parents[1] / "bitnest_mlx" / "demo_model"

# Every width the converter needs: K of each Linear a multiple of 128 (the weight group),
# intermediate a power of two (R4 Hadamard with K = 1), head_dim 64 (KV group 32 divides it).
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def corpus_files(root: Path = LICENSES) -> list[Path]:
    """The license texts, each once (GPL, LGPL and GFDL are symlinks to a versioned file)."""
    files = {p.resolve() for p in root.iterdir() if p.is_file() and p.name != HELD_OUT}
    return sorted(files)


def train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> None:
    """Byte-level BPE (GPT-2 style) with one special token, <|endoftext|>, which is also EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}
    config["model_max_length"] = CONFIG["max_position_embeddings"]
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_corpus(out: Path, texts: list[str]) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for t in texts:
        ids += tok.encode(t).ids + [eos]
    return np.asarray(ids, dtype=np.int32)


def train(
    args: argparse.Namespace, ids: np.ndarray, vocab: int, save: Path | None = None
) -> llama.Model:
    """AdamW with warmup and cosine decay on random windows; with `save`, the checkpoint is
    rewritten every --save-every steps (a long run stopped early can still be converted)."""
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    config = {**CONFIG, "vocab_size": vocab}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {n_params / 1e6:.2f} M parameters, {ids.size} training tokens", flush=True)

    warmup = max(1, args.steps // 20)
    lr = optim.join_schedules(
        [
            optim.linear_schedule(args.lr / warmup, args.lr, warmup),
            optim.cosine_decay(args.lr, args.steps - warmup, args.lr / 10),
        ],
        [warmup],
    )
    opt = optim.AdamW(learning_rate=lr, weight_decay=0.1)

    def loss_fn(model: llama.Model, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    step_fn = nn.value_and_grad(model, loss_fn)
    seq = args.seq_len
    tic, running = time.perf_counter(), None
    for step in range(args.steps):
        starts = rng.integers(0, ids.size - seq - 1, size=args.batch)
        batch = np.stack([ids[s : s + seq + 1] for s in starts])
        loss, grads = step_fn(model, mx.array(batch[:, :-1]), mx.array(batch[:, 1:]))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(
                f"step {step + 1}/{args.steps}  loss {running:.3f}  ppl {math.exp(running):.1f}  "
                f"lr {lr(mx.array(step)).item():.2e}  {time.perf_counter() - tic:.0f} s",
                flush=True,
            )
        if save is not None and (step + 1) % args.save_every == 0:
            write_checkpoint(model, vocab, save)
    return model


def write_checkpoint(model: llama.Model, vocab: int, out: Path) -> None:
    """Hugging Face layout: config.json + model.safetensors (+ the tokenizer files already)."""
    eos = json.loads((out / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    config = {**CONFIG, "vocab_size": vocab, "eos_token_id": eos, "bos_token_id": eos}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=SHIPPED, help="package directory to (re)write")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--save-every", type=int, default=100, help="checkpoint period (steps)")
    p.add_argument("--keep-float", type=Path, help="also keep the float checkpoint here")
    p.add_argument(
        "--convert-only", action="store_true", help="convert the --keep-float checkpoint as it is"
    )
    args = p.parse_args(argv)
    if not LICENSES.is_dir():
        print(f"error: {LICENSES} not found (the corpus: Debian's license texts)", file=sys.stderr)
        return 2

    mx.set_default_device(mx.cpu)
    files = corpus_files()
    texts = [f.read_text(encoding="utf-8") for f in files]
    print(f"corpus: {', '.join(f.name for f in files)} ({sum(map(len, texts))} chars)")

    from bitnest_mlx.convert import ConvertSettings, convert

    with tempfile.TemporaryDirectory(prefix="bitnest-demo-") as tmp:
        hf = args.keep_float or Path(tmp) / "bitnest-demo"
        hf.mkdir(parents=True, exist_ok=True)
        if not args.convert_only:
            train_tokenizer(texts, args.vocab, hf)
            ids = encode_corpus(hf, texts)
            tic = time.perf_counter()
            model = train(args, ids, args.vocab, hf if args.keep_float else None)
            print(f"trained in {time.perf_counter() - tic:.0f} s", flush=True)
            write_checkpoint(model, args.vocab, hf)
        calib = Path(tmp) / "calib.txt"
        calib.write_text("\n\n".join(texts), encoding="utf-8")
        summary = convert(
            hf_path=hf,
            out=args.out,
            settings=ConvertSettings(calib=calib, calib_tokens=16384, seed=args.seed),
            scratch=Path(tmp),
            force=True,
        )
    print(f"package: {summary['out']} (mean W4 rel. error {summary['mean_w4_rel_fro_err']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
