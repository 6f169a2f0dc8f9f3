"""A real-size Hugging Face Llama checkpoint of seeded random weights, for measuring conversion.

`make_checkpoint` writes what `--hf-path` reads (config.json as transformers 5 writes it, sharded
safetensors + index, a byte-level BPE tokenizer) without downloading real weights. Each tensor is
generated and written in row blocks straight into its shard, whose header is known from the
shapes alone, so memory stays near one block whatever the model size.

The statistics imitate a trained model enough for calibration to mean something: Linears and
embeddings ~ N(0, 0.02²), RMSNorm weights log-normal around 1, and a few hidden channels whose
norm weights are several times larger (the "massive activation" channels of trained models,
shared by every layer), so the folded Linears get outlier input columns.

`python -m bitnest_mlx.convert make-checkpoint --like llama-3.2-3b --out DIR [--tiny]`.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

# config.json as transformers 5.25 writes LlamaConfig(...).save_pretrained for these models.
PRESETS: dict[str, dict] = {
    "llama-3.2-3b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "dtype": "bfloat16",
        "eos_token_id": 128001,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 24,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "transformers_version": "5.25.0",
        "use_cache": True,
        "vocab_size": 128256,
    },
}
# The same family at dimensions where a whole conversion takes seconds (CI).
TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "bos_token_id": 510,
    "eos_token_id": 511,
}
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}  # safetensors names
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
WEIGHT_STD = 0.02
NORM_SPREAD = 0.2  # log-normal sigma of the RMSNorm weights
OUTLIER_GAIN = 5.0  # norm weight multiplier on the outlier channels
BLOCK_BYTES = 64 * 2**20  # float32 generated per step


def preset(like: str, tiny: bool = False) -> dict:
    """A copy of the config.json of PRESETS[like], at TINY's dimensions if `tiny`."""
    if like not in PRESETS:
        raise ValueError(f"--like {like!r}: expected one of {sorted(PRESETS)}")
    config = copy.deepcopy(PRESETS[like])
    return {**config, **TINY} if tiny else config


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape, in the order transformers' state dict lists them (lm_head only if untied)."""
    d, f, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
            }
        )
    shapes["model.norm.weight"] = (d,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], d)
    return shapes


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even (numpy has no bf16)."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _encode(x: np.ndarray, dtype: str) -> bytes:
    if dtype == "bfloat16":
        return _bf16_bits(x).tobytes()
    return x.astype(dtype).tobytes()


def _blocks(
    shape: tuple[int, ...], rng: np.random.Generator, outliers: np.ndarray
) -> Iterator[np.ndarray]:
    """float32 row blocks of one tensor drawn from its own stream `rng`."""
    if len(shape) == 1:  # an RMSNorm weight
        g = np.exp(rng.normal(0.0, NORM_SPREAD, shape)).astype(np.float32)
        g[outliers] *= OUTLIER_GAIN
        yield g
        return
    rows = max(1, BLOCK_BYTES // (4 * shape[1]))
    for r in range(0, shape[0], rows):
        block = rng.standard_normal((min(rows, shape[0] - r), shape[1]), dtype=np.float32)
        block *= WEIGHT_STD
        yield block


def _plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, limit: int) -> list[list[str]]:
    """Consecutive tensors grouped into shards of at most `limit` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * itemsize
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _write_shard(path: Path, names: list[str], shapes: dict, seed: int, dtype: str, bar) -> None:
    """One safetensors file, written tensor by tensor: 8-byte header length, JSON header
    (padded with spaces to 8 bytes), then the tensors' bytes in header order.

    Each tensor draws from its own stream (seed, its index in `shapes`), so its values do not
    depend on the sharding; the outlier channels are the same in every norm, as in trained
    models."""
    order = list(shapes)
    d = shapes["model.norm.weight"][0]
    outliers = np.random.default_rng([seed, len(order)]).choice(d, max(1, d // 512), replace=False)
    itemsize = ITEMSIZE[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        n = int(np.prod(shapes[name])) * itemsize
        header[name] = {
            "dtype": DTYPES[dtype],
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in names:
            rng = np.random.default_rng([seed, order.index(name)])
            for block in _blocks(shapes[name], rng, outliers):
                f.write(_encode(block, dtype))
                bar.update(block.size * itemsize)


def write_tokenizer(out: Path, config: dict) -> None:
    """A byte-level BPE trained on the built-in calibration corpus: ids below bos_token_id are
    regular tokens (the trained vocabulary, padded with unused fillers), bos_token_id and above
    are special tokens (<|begin_of_text|>, <|end_of_text|>, reserved), as in Llama 3."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    from .calib import builtin_corpus

    n_regular, vocab = config["bos_token_id"], config["vocab_size"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_regular,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([builtin_corpus()], trainer)
    model = json.loads(tok.to_str())["model"]
    ids = model["vocab"]
    for i in range(len(ids), n_regular):
        ids[f"<|unused_{i}|>"] = i
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    special += [f"<|reserved_special_token_{i}|>" for i in range(vocab - n_regular - 2)]
    ids.update({t: n_regular + i for i, t in enumerate(special)})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    # Llama 3 prepends <|begin_of_text|> in the post-processor, not through add_bos_token.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{special[0]} $A", special_tokens=[(special[0], n_regular)]
    )
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special[0],
        "eos_token": special[1],
        "model_max_length": config["max_position_embeddings"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def make_checkpoint(
    out: Path,
    like: str = "llama-3.2-3b",
    *,
    tiny: bool = False,
    seed: int = 0,
    dtype: str = "bfloat16",
    shard_bytes: int = 2 * 2**30,
    progress: bool = True,
) -> Path:
    """Write a Hugging Face checkpoint directory of seeded random weights shaped like `like`
    (see PRESETS; `tiny`: the same family at small dimensions) and return its path.

    The directory is assembled in a hidden sibling and renamed into place when complete, so an
    interrupted run never leaves a half-written `out`; an existing `out` is refused."""
    from tqdm import tqdm

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: choose a new directory")
    config = {**preset(like, tiny), "dtype": dtype}
    shapes = tensor_shapes(config)
    itemsize = ITEMSIZE[dtype]
    shards = _plan_shards(shapes, itemsize, shard_bytes)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(tmp, config)
        weight_map = {}
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            size = sum(int(np.prod(shapes[n])) for n in names) * itemsize
            with tqdm(
                total=size, unit="B", unit_scale=True, desc=file, disable=not progress
            ) as bar:
                _write_shard(tmp / file, names, shapes, seed, dtype, bar)
            weight_map.update(dict.fromkeys(names, file))
        total = sum(int(np.prod(s)) for s in shapes.values()) * itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bitnest_mlx.convert make-checkpoint",
        description="Write a Hugging Face Llama checkpoint of seeded random weights (real-size "
        "config, sharded safetensors, a byte-level BPE tokenizer) to measure conversion without "
        "downloading a model.",
    )
    p.add_argument("--like", choices=sorted(PRESETS), default="llama-3.2-3b", help="model shape")
    p.add_argument("--out", required=True, help="checkpoint directory to create (must not exist)")
    p.add_argument("--tiny", action="store_true", help="same family at small dimensions (CI)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument(
        "--shard-gb", type=float, default=2.0, help="shard size limit in GiB (default 2)"
    )
    args = p.parse_args(argv)
    try:
        path = make_checkpoint(
            Path(args.out),
            args.like,
            tiny=args.tiny,
            seed=args.seed,
            dtype=args.dtype,
            shard_bytes=int(args.shard_gb * 2**30),
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
