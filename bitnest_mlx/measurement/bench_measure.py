"""The bench's measurements: prefill and generation tok/s with peak memory, best of several
runs, the mlx-lm peer model and the bench prompt (`bench.py` puts them together)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama


def best_of(fn: Callable[[], dict], repeats: int, key: str) -> dict:
    """Best of `repeats` runs by `key`; a shared CPU makes single runs noisy."""
    return max((fn() for _ in range(max(repeats, 1))), key=lambda r: r[key])


def measure_prefill(model: nn.Module, prompt: mx.array, **kw) -> dict:
    """One forward pass over the whole prompt (after a short warm-up): tok/s and peak memory."""
    mx.eval(model(prompt[None, :8], model.make_cache(), **kw))
    mx.reset_peak_memory()
    tic = time.perf_counter()
    mx.eval(model(prompt[None], model.make_cache(), **kw))
    seconds = time.perf_counter() - tic
    return {"tps": prompt.size / seconds, "peak_memory_gb": mx.get_peak_memory() / 1e9}


def measure_generation(steps: Callable[[], Iterator], n: int) -> dict:
    """Generation tok/s from the first token on (prompt time excluded, like mlx-lm)."""
    for _ in zip(range(2), steps()):  # warm-up: first-call allocation and compilation
        pass
    mx.reset_peak_memory()
    tic, count = None, 0
    for _ in steps():
        count += 1
        if tic is None:
            tic = time.perf_counter()
    seconds = time.perf_counter() - tic
    return {
        "tps": (count - 1) / seconds if count > 1 else 0.0,
        "tokens": count,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
    }


def mlx_lm_peer(args, bits: int, dtype: mx.Dtype) -> nn.Module:
    """mlx-lm's Llama with this package's dims and weight group, random weights, nn.quantize."""
    a = args
    peer = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=a.hidden_size,
            num_hidden_layers=a.num_hidden_layers,
            intermediate_size=a.intermediate_size,
            num_attention_heads=a.num_attention_heads,
            num_key_value_heads=a.num_key_value_heads,
            head_dim=a.head_dim,
            rms_norm_eps=a.rms_norm_eps,
            vocab_size=a.vocab_size,
            rope_theta=a.rope_theta,
            rope_scaling=a.rope_scaling,
            max_position_embeddings=a.max_position_embeddings,
            tie_word_embeddings=False,
        )
    )
    peer.set_dtype(dtype)
    # The package's group: the peer then reads as many scale bytes per weight as the planes.
    nn.quantize(peer, group_size=a.group_size, bits=bits)
    mx.eval(peer.parameters())
    return peer


# Plain English prose for prompts, so that acceptance is that of ordinary text.
BENCH_TEXT = """\
The river runs slowly past the old mill, and in the evening the light falls across the water
like a sheet of copper. People walk along the bank with their dogs, and children throw stones to
see how far they can skip. In the spring the water rises and the meadow floods, and the birds come
back from the south to build their nests in the reeds. There is a small bridge made of stone where
the road crosses the river, and a bench beside it where the older people of the village sit and
talk about the weather, the price of bread and the news from the town.
"""


def bench_prompt(tokenizer, n: int, vocab: int) -> mx.array:
    """`n` tokens of English text (repeated as needed), so acceptance is realistic."""
    if tokenizer is None:  # a bundle without tokenizer files (synthetic): any ids will do
        return mx.array([2 + i % (vocab - 2) for i in range(n)], dtype=mx.uint32)
    ids = [t for t in tokenizer.encode(" ".join(BENCH_TEXT.split())) if t < vocab]
    return mx.array((ids * (n // max(len(ids), 1) + 1))[:n], dtype=mx.uint32)
