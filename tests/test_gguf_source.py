"""GGUF files as converter inputs (convert/gguf_source.py): llama.cpp's names, q/k layout and
quantized types back to HF float32, the llama3 RoPE scaling recovered from rope_freqs, tokenizers
built by transformers (any pre-tokenizer it knows, BOS as the file says, no torch needed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from factory import VOCAB, float_weights, state, tiny_dims, tiny_hf  # noqa: E402
from test_sources import LLAMA32, growth  # noqa: E402

from bitnest_mlx.convert.gguf_source import (  # noqa: E402
    _bos_eos_template,
    _gguf_header,
    _gguf_tokenizer,
    _gguf_tokenizer_public,
    unpermute_qk,
)
from bitnest_mlx.convert.rope import rope_params  # noqa: E402
from bitnest_mlx.convert.sources import SourceError, load_gguf  # noqa: E402

# ---------------------------------------------------------------------------------------------
# GGUF files as llama.cpp writes them (names, q/k permutation, byte-level BPE, rope_freqs)

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The q/k row interleaving llama.cpp's HF->GGUF converter applies for arch llama."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_cpp_rope_freqs(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it from a llama3 rope_scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            out.append(1.0)
        elif wavelength > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    config: dict,
    *,
    pre: str | None = None,
    rope_freqs: np.ndarray | None = None,
    rope_scaling_meta: dict | None = None,
    add_bos: bool | None = None,
    tensor_type=None,
) -> None:
    """A GGUF of HF `weights` (float32, or `tensor_type`) with a byte-level BPE vocabulary:
    token i < 256 is byte i, one merge ("Ġ Ġ"), then <|endoftext|> and reserved controls."""
    from bitnest_mlx.runtime.demo import _bytes_to_unicode

    arch = config["model_type"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    writer.add_rope_freq_base(rope_params(config)[0])
    writer.add_context_length(config.get("max_position_embeddings", 512))
    for key, value in (rope_scaling_meta or {}).items():
        getattr(writer, f"add_rope_scaling_{key}")(value)
    tokens = [_bytes_to_unicode()[b] for b in range(256)] + ["ĠĠ", "<|endoftext|>"]
    vocab = weights["model.embed_tokens.weight"].shape[0]
    tokens += [f"<|reserved_{i}|>" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or ("qwen2" if arch == "qwen2" else "llama-bpe"))
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3] * (vocab - 257))
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_eos_token_id(257)
    if add_bos is not None:
        writer.add_bos_token_id(257)
        writer.add_add_bos_token(add_bos)
    for k, v in weights.items():
        if k in GGUF_NAMES:
            name = GGUF_NAMES[k]
        else:
            parts = k.split(".")
            mod = ".".join(parts[3:-1])
            name = f"blk.{parts[2]}.{GGUF_LAYER[mod]}.{parts[-1]}"
            if arch == "llama" and mod in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config["num_attention_heads" if "q_proj" in mod else "num_key_value_heads"]
                v = llama_cpp_permute(v, heads)
        v = np.ascontiguousarray(v, dtype=np.float32)
        if tensor_type is not None and v.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(v, tensor_type), raw_dtype=tensor_type)
        else:
            writer.add_tensor(name, v)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_config(model) -> dict:
    return model.config.to_dict()


def test_unpermute_qk_inverts_llama_cpp_permutation():
    w = np.arange(4 * 128 * 3, dtype=np.float32).reshape(4 * 128, 3)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, 4), 4), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_reader_recovers_hf_weights_and_tokenizer(tmp_path, arch):
    model = tiny_hf(arch)
    write_gguf(tmp_path / "m.gguf", state(model), hf_config(model))
    with load_gguf(tmp_path / "m.gguf", tmp_path / "tok") as source:
        assert sorted(source.names()) == sorted(state(model))
        for k, v in state(model).items():
            assert source.shape(k) == v.shape, k
            np.testing.assert_array_equal(source.tensor(k), v, err_msg=k)
        assert source.config["model_type"] == arch
        assert source.config["num_key_value_heads"] == 1
        assert source.config["vocab_size"] == VOCAB
        assert source.name == "m"  # no general.name: the file's stem
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(tmp_path / "tok")
    ids = tok.encode("hello world")
    assert ids == list(b"hello world")
    assert tok.decode(ids) == "hello world"
    assert tok.encode("a  ") == [97, 256]  # the merge: one token for the two spaces


def test_gguf_q8_tensors_are_dequantized_and_llama_qk_unpermuted(tmp_path):
    weights, config = float_weights("llama", n_layers=1, vocab=VOCAB, llama3_rope=False)
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_gguf(tmp_path / "m.gguf", weights, config, tensor_type=q8)
    source = load_gguf(tmp_path / "m.gguf", tmp_path / "tok")
    for k, v in weights.items():
        want = gguf.quants.dequantize(gguf.quants.quantize(v.astype(np.float32), q8), q8)
        np.testing.assert_array_equal(source.tensor(k), want if v.ndim == 2 else v, err_msg=k)
    source.close()


def test_gguf_with_a_pre_tokenizer_of_its_own_loads(tmp_path):
    """'smollm' (SmolLM2): a pre-tokenizer the old hand-written rebuild refused."""
    model = tiny_hf("llama")
    write_gguf(tmp_path / "m.gguf", state(model), hf_config(model), pre="smollm")
    load_gguf(tmp_path / "m.gguf", tmp_path / "tok").close()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    assert load_tokenizer(tmp_path / "tok").encode("hello world") == list(b"hello world")


@pytest.mark.parametrize("add_bos", [True, False])
def test_gguf_add_bos_token_is_what_the_written_tokenizer_does(tmp_path, add_bos):
    model = tiny_hf("qwen2")
    write_gguf(tmp_path / "m.gguf", state(model), hf_config(model), add_bos=add_bos)
    load_gguf(tmp_path / "m.gguf", tmp_path / "tok").close()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    settings = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert settings["add_bos_token"] is add_bos and settings["bos_token"] == "<|endoftext|>"
    assert load_tokenizer(tmp_path / "tok").encode("hi") == [257] * add_bos + list(b"hi")


def test_gguf_tokenizer_is_the_one_transformers_reads_from_the_file(tmp_path):
    """Built from our metadata as transformers' get_gguf_tokenizer builds it from its own read
    of the file; the fallback for releases without `integrations.gguf` (AutoTokenizer) too,
    whose loader already applies add_bos_token as `_bos_eos_template` does."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    model = tiny_hf("llama")
    path = tmp_path / "m.gguf"
    write_gguf(path, state(model), hf_config(model), add_bos=True)
    ours, a = _gguf_tokenizer(path, _gguf_header(path)[0])
    arch, tokenizer, b = get_gguf_tokenizer(str(path))
    assert ours.to_str() == convert_gguf_tokenizer(arch, tokenizer)[0].to_str() and a == b
    public, c = _gguf_tokenizer_public(path)
    assert {k: v for k, v in a.items() if v} == {k: v for k, v in c.items() if v}
    assert ours.to_str() != public.to_str()  # BOS: only the public loader adds it itself
    ours.post_processor = _bos_eos_template(ours, a)
    assert ours.to_str() == public.to_str()
    public.post_processor = _bos_eos_template(public, c)
    assert ours.to_str() == public.to_str()


def test_gguf_loads_without_torch(tmp_path):
    """transformers' GGUF reader imports torch; the converter's path through it must not."""
    model = tiny_hf("qwen2")
    write_gguf(tmp_path / "m.gguf", state(model), hf_config(model))
    script = (
        "import sys; sys.modules['torch'] = None\n"  # import torch now fails
        "from pathlib import Path\n"
        "from bitnest_mlx.convert.sources import load_gguf\n"
        f"s = load_gguf(Path({str(tmp_path / 'm.gguf')!r}), Path({str(tmp_path / 'tok')!r}))\n"
        "print(len(s.names()), s.tensor('model.norm.weight').shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == str(len(state(model)))
    assert (tmp_path / "tok" / "tokenizer.json").is_file()


def test_gguf_without_transformers_says_what_to_install(tmp_path, monkeypatch):
    """(mlx-lm needs transformers too: the `convert` extra is there for its version.)"""
    model = tiny_hf("qwen2")
    write_gguf(tmp_path / "m.gguf", state(model), hf_config(model))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    with pytest.raises(SourceError, match=r"m\.gguf: .* needs transformers: pip install 'bitnest"):
        load_gguf(tmp_path / "m.gguf", tmp_path / "tok")


def test_gguf_of_another_architecture_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SourceError, match=r"g\.gguf: GGUF architecture 'gemma3'"):
        load_gguf(tmp_path / "g.gguf", tmp_path / "tok")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(SourceError, match=r"junk\.gguf: unreadable GGUF file"):
        load_gguf(tmp_path / "junk.gguf", tmp_path / "tok")


def mlx_llama3_freqs(theta: float, scaling: dict, head_dim: int = 128) -> np.ndarray:
    from mlx_lm.models.rope_utils import Llama3RoPE

    return np.array(Llama3RoPE(head_dim, 131072, False, theta, scaling)._freqs)


@pytest.mark.parametrize(
    "scaling, meta",
    [
        (LLAMA32, False),  # Llama 3.2 as llama.cpp writes it: rope_freqs only
        (LLAMA32, True),
        # Another context: without metadata the tensor fixes only context / the two factors,
        # so other values come back with the same frequencies; with it, the same values.
        ({**LLAMA32, "original_max_position_embeddings": 4096, "low_freq_factor": 2.0}, False),
        ({**LLAMA32, "original_max_position_embeddings": 4096, "low_freq_factor": 2.0}, True),
    ],
)
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path, scaling, meta):
    weights, config = float_weights("llama", n_layers=1, vocab=VOCAB, llama3_rope=False)
    divisors = llama_cpp_rope_freqs(500000.0, 128, scaling)
    context = scaling["original_max_position_embeddings"]
    write_gguf(
        tmp_path / "m.gguf",
        weights,
        config,
        rope_freqs=divisors,
        rope_scaling_meta=(
            {"factor": scaling["factor"], "orig_ctx_len": context} if meta else None
        ),
    )
    source = load_gguf(tmp_path / "m.gguf", tmp_path / "tok")
    assert "rope_freqs.weight" not in source.names()
    got = source.config["rope_scaling"]
    if meta or context == 8192:
        assert got == scaling
    np.testing.assert_allclose(
        mlx_llama3_freqs(500000.0, got), mlx_llama3_freqs(500000.0, scaling), rtol=1e-6
    )


def test_rope_freqs_that_are_no_llama3_scaling_are_refused(tmp_path):
    weights, config = float_weights("llama", n_layers=1, vocab=VOCAB, llama3_rope=False)
    divisors = np.random.default_rng(0).uniform(1, 8, 64).astype(np.float32)
    write_gguf(tmp_path / "m.gguf", weights, config, rope_freqs=divisors)
    with pytest.raises(SourceError, match=r"m\.gguf: rope_freqs.weight is not a llama3 RoPE"):
        load_gguf(tmp_path / "m.gguf", tmp_path / "tok")


def test_llama3_gguf_gives_the_logits_of_the_model_it_was_written_from(tmp_path):
    """A transformers Llama with llama3 scaling (context 128, so a short test reaches it), as
    llama.cpp writes it, rebuilt from what load_gguf recovers: the same logits far into the
    context. Without the scaling they differ."""
    model = tiny_hf("llama")
    theta, scaling = rope_params(hf_config(model))
    write_gguf(
        tmp_path / "m.gguf",
        state(model),
        hf_config(model),
        rope_freqs=llama_cpp_rope_freqs(theta, 128, scaling),
    )
    source = load_gguf(tmp_path / "m.gguf", tmp_path / "tok")
    tokens = torch.tensor([[1, 5, 9, 200, 33, 7, 64, 12]])
    positions = torch.arange(900, 908)[None]

    def logits(rope_scaling: dict | None) -> np.ndarray:
        params = {"rope_theta": source.config["rope_theta"], **(rope_scaling or {})}
        params.setdefault("rope_type", "default")
        rebuilt = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**tiny_dims(), rope_parameters=params)
        )
        rebuilt.load_state_dict({k: torch.tensor(source.tensor(k)) for k in source.names()})
        with torch.no_grad():
            return rebuilt.eval()(tokens, position_ids=positions).logits.numpy()

    with torch.no_grad():
        want = model(tokens, position_ids=positions).logits.numpy()
    np.testing.assert_allclose(logits(source.config["rope_scaling"]), want, atol=2e-5)
    assert np.abs(logits(None) - want).max() > 1e-3


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="RSS read from /proc")
def test_reading_gguf_tensor_by_tensor_keeps_memory_at_one_tensor(tmp_path):
    """Q8_0 blocks dequantize to several temporaries per float32 value: by row blocks, they
    stay at a few MB."""
    one = 2048 * 2048  # 16 MB as float32, the largest tensor below
    weights, config = float_weights(
        "llama", n_layers=3, hidden=1024, intermediate=4096, heads=8, kv_heads=8, vocab=VOCAB
    )
    write_gguf(tmp_path / "m.gguf", weights, config, tensor_type=gguf.GGMLQuantizationType.Q8_0)
    grew, total = growth(tmp_path / "m.gguf")
    assert total > 8 * 4 * one and grew < 3 * 4 * one, grew
