"""Calibration runs through the runtime's own forward: its hidden states are transformers' on the
same tokens, for a checkpoint saved by transformers 5 (RoPE only under `rope_parameters`)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bitnest_mlx.convert.calibrate import Calibration  # noqa: E402
from bitnest_mlx.convert.package import stored_embedding, stored_layer  # noqa: E402
from bitnest_mlx.convert.sources import Source  # noqa: E402
from bitnest_mlx.formats.bitnest.writer import PackageWriter  # noqa: E402
from bitnest_mlx.formats.hadamard import hadamard_k, split_k  # noqa: E402

ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved by transformers 5, its config.json as written, and its hidden states."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rope_parameters=ROPE,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.tensor(rng.uniform(0.5, 1.5, p.shape), dtype=torch.float32))
    out = tmp_path_factory.mktemp("hf")
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    tokens = rng.integers(0, 300, (2, 96))
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), output_hidden_states=True).hidden_states
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return config, weights, tokens, [h.numpy() for h in hidden]


def calibration_hidden_states(config: dict, weights: dict, tokens: np.ndarray) -> list:
    """The calibration forward, float weights and A8 off: hidden states after each layer."""
    import mlx.core as mx

    source = Source.from_arrays(weights, config)
    c = source.config
    had = hadamard_k(split_k(c["intermediate_size"]))
    spec = PackageWriter.spec_for(c, had_k=had)
    calib = Calibration(spec, mx.array(stored_embedding(source, None)), tokens, had)
    states = []
    for i in range(c["num_hidden_layers"]):
        calib.float_advance(i, stored_layer(source, i, None, None, had))
        states.append(calib.h.copy())
    return states


def test_saved_config_has_rope_only_under_rope_parameters(saved):
    config = saved[0]
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert "rope_theta" not in config and config.get("rope_scaling") is None


def test_calibration_forward_equals_transformers_with_llama3_rope_parameters(saved):
    config, weights, tokens, hidden = saved
    ours = calibration_hidden_states(config, weights, tokens)
    # hidden[i + 1] is the residual stream after layer i (the last one is after the final norm).
    np.testing.assert_allclose(ours[0], hidden[1], atol=1e-4, rtol=0)
    norm = weights["model.norm.weight"]
    last = ours[1] / np.sqrt(np.mean(ours[1] ** 2, axis=-1, keepdims=True) + 1e-6) * norm
    np.testing.assert_allclose(last, hidden[2], atol=1e-4, rtol=0)


def test_calibration_forward_with_theta_10000_would_not_match(saved):
    config, weights, tokens, hidden = saved
    plain = {k: v for k, v in config.items() if k != "rope_parameters"}
    ours = calibration_hidden_states(plain, weights, tokens)
    assert np.abs(ours[0] - hidden[1]).max() > 1e-2
