"""mlx-lm sees bitnest packages and DSV4 bundles: CLI via the startup hook, load, generate,
prompt cache, and self-speculation through `--draft-model PATH#draft` (shared-cache loop)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import mlx.core as mx
import pytest
from factory import break_package, make_package

import bitnest_mlx
from bitnest_mlx.runtime.demo import demo_path, write_tokenizer


@pytest.fixture(scope="module")
def mlx_lm():
    bitnest_mlx.register_mlx_lm()  # a no-op when the installed hook already did it
    import mlx_lm

    return mlx_lm


@pytest.fixture(scope="module")
def package() -> str:
    return str(demo_path())


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    from bitnest_mlx.runtime.demo import write_demo_bundle

    path = write_demo_bundle(tmp_path_factory.mktemp("dsv4") / "bundle")
    write_tokenizer(Path(path))  # byte-level: the bundle's 256 ids are the bytes
    return str(path)


def _mlx_lm_cli(model: str, cwd: Path, *extra: str) -> str:
    """`python -m mlx_lm generate` in a fresh interpreter that never imports bitnest_mlx itself."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--model", model, "--prompt", "hi"]
        + ["--max-tokens", "8", *extra],
        cwd=cwd,  # outside the repo: only the installed package is importable
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("==========")[1].strip("\n")


def test_hook_pth_is_installed_in_site_packages():
    purelib = Path(sysconfig.get_paths()["purelib"])
    assert (purelib / "bitnest_mlx_hook.pth").read_text().startswith("import bitnest_mlx_hook")


def test_the_hook_and_the_plugin_watch_the_same_modules():
    """The stdlib-only hook keeps its own list (it imports nothing of ours at startup); the
    plugin's finder (register() without the hook) acts on the same one."""
    import bitnest_mlx_hook
    from bitnest_mlx.mlx_lm_integration import plugin

    assert bitnest_mlx_hook.WATCHED == plugin.WATCHED


def test_mlx_lm_cli_generates_from_bitnest_package(package, tmp_path):
    assert _mlx_lm_cli(package, tmp_path)


def test_mlx_lm_cli_self_speculation_with_draft_marker_matches_target(package, tmp_path):
    plain = _mlx_lm_cli(package, tmp_path)
    assert _mlx_lm_cli(package, tmp_path, "--draft-model", package + "#draft") == plain


def test_mlx_lm_cli_generates_from_dsv4_bundle(bundle, tmp_path):
    assert _mlx_lm_cli(bundle, tmp_path)


def test_mlx_lm_load_builds_bitnest_model_with_manifest_fields(mlx_lm, package):
    from bitnest_mlx.models.bitnest_llama import Model

    model, tokenizer, config = mlx_lm.load(package, return_config=True)
    assert isinstance(model, Model) and model.mode == "target"
    assert "quantization" not in config
    # R4's K on every down_proj comes from bitnest.json, not config.json.
    manifest = json.loads((Path(package) / "bitnest.json").read_text())
    ks = [entry["K"] for entry in manifest["online_hadamard"]["layers"].values()]
    assert len(ks) == len(model.layers) and [r["K"] for r in model.args.r4] == ks
    assert [layer.mlp.r4.k for layer in model.layers] == ks


def test_draft_marker_returns_view_over_the_same_arrays(mlx_lm, package):
    from bitnest_mlx.mlx_lm_integration.plugin import DraftView

    model, tokenizer = mlx_lm.load(package)
    draft, draft_tokenizer = mlx_lm.load(package + "#draft")
    assert isinstance(draft, DraftView) and draft.target is model
    assert draft.layers[0].self_attn.q_proj.hi is model.layers[0].self_attn.q_proj.hi
    assert draft_tokenizer.vocab_size == tokenizer.vocab_size
    tokens = mx.array([[72, 105]])
    assert mx.array_equal(draft(tokens), model(tokens, mode="draft"))
    assert not mx.array_equal(draft(tokens), model(tokens))


def test_mlx_lm_stream_generate_speculative_uses_shared_cache_loop(mlx_lm, package):
    model, tokenizer = mlx_lm.load(package)
    draft, _ = mlx_lm.load(package + "#draft")
    prompt = "The river runs slowly"
    plain = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=24)]
    spec = list(
        mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=24, draft_model=draft, num_draft_tokens=3
        )
    )
    assert [r.token for r in spec] == plain  # greedy: lossless
    assert any(r.from_draft for r in spec)  # drafts were accepted, so the draft ran
    assert draft.make_cache() == []  # one nested cache, the target's


def test_prompt_cache_continues_like_a_fresh_prompt(mlx_lm, package):
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model, tokenizer = mlx_lm.load(package)
    draft, _ = mlx_lm.load(package + "#draft")
    first = tokenizer.encode("The mill has not turned")
    more = tokenizer.encode(" for many years")
    for draft_model in (None, draft):
        kw = dict(max_tokens=6, draft_model=draft_model)
        cache = make_prompt_cache(model) + (make_prompt_cache(draft) if draft_model else [])
        out = [
            r.token
            for r in mlx_lm.stream_generate(model, tokenizer, first, prompt_cache=cache, **kw)
        ]
        # Like mlx-lm's server: trim the cache to the tokens both sides agree on, feed the rest.
        keep = len(first) + len(out) - 1
        assert cache[0].offset >= keep
        trim_prompt_cache(cache, cache[0].offset - keep)
        cached = [
            r.token
            for r in mlx_lm.stream_generate(
                model, tokenizer, out[-1:] + more, prompt_cache=cache, **kw
            )
        ]
        fresh = [
            r.token for r in mlx_lm.stream_generate(model, tokenizer, first + out + more, **kw)
        ]
        assert cached == fresh


def test_mlx_lm_samplers_map_to_bitnest_sampler():
    from mlx_lm.sample_utils import make_sampler

    from bitnest_mlx.mlx_lm_integration.plugin import as_bitnest_sampler
    from bitnest_mlx.runtime.speculative import Sampler

    assert as_bitnest_sampler(None) == Sampler()
    assert as_bitnest_sampler(make_sampler(0.0)) == Sampler()
    got = as_bitnest_sampler(make_sampler(0.7, top_p=0.9, min_p=0.05, top_k=5))
    assert got == Sampler(temp=0.7, top_p=0.9, min_p=0.05, min_tokens_to_keep=1, top_k=5)
    assert as_bitnest_sampler(make_sampler(0.7, xtc_probability=0.5)) is None
    assert as_bitnest_sampler(lambda lp: mx.argmax(lp, -1)) is None


def test_draft_view_of_another_target_is_refused(mlx_lm, package):
    from bitnest_mlx.mlx_lm_integration.plugin import DraftView

    model, tokenizer = mlx_lm.load(package)
    other, _ = bitnest_mlx.load(package)
    with pytest.raises(ValueError, match="own target"):
        list(mlx_lm.stream_generate(model, tokenizer, "hi", draft_model=DraftView(other)))


def test_other_draft_models_run_mlx_lm_own_loop(mlx_lm, package, monkeypatch):
    from bitnest_mlx.mlx_lm_integration.plugin import patch_generate

    model, tokenizer = mlx_lm.load(package)
    separate, _ = bitnest_mlx.load(package, mode="draft")  # a model of its own, not a view
    plain = [r.token for r in mlx_lm.stream_generate(model, tokenizer, "The river", max_tokens=8)]
    gen, calls = sys.modules["mlx_lm.generate"], []
    original = gen.speculative_generate_step.__wrapped__  # mlx-lm's two-cache loop
    spy = lambda *a, **k: calls.append(1) or original(*a, **k)  # noqa: E731
    monkeypatch.setattr(gen, "speculative_generate_step", spy)
    patch_generate(gen)  # wrapped by the plugin like the real one
    out = mlx_lm.stream_generate(model, tokenizer, "The river", max_tokens=8, draft_model=separate)
    assert [r.token for r in out] == plain
    assert calls


def test_mlx_lm_load_and_generate_dsv4_bundle(mlx_lm, bundle):
    from bitnest_mlx.models.deepseek_v4 import Model

    model, tokenizer = mlx_lm.load(bundle)
    assert isinstance(model, Model)
    text = mlx_lm.generate(model, tokenizer, "hi", max_tokens=6)
    assert isinstance(text, str) and len(tokenizer.encode(text)) > 0


def test_prompt_cache_file_round_trip_restores_nested_cache(mlx_lm, package, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    model, tokenizer = mlx_lm.load(package)
    cache = make_prompt_cache(model)
    model(mx.array([tokenizer.encode("The river runs")]), cache=cache)
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert [type(c).__name__ for c in loaded] == ["NestedKVCache"] * len(cache)
    step = mx.array([tokenizer.encode(" slowly")])
    want, got = model(step, cache=cache), model(step, cache=loaded)
    assert mx.array_equal(want, got)
    assert (loaded[0].group_size, loaded[0].quantized) == (cache[0].group_size, True)


# ---------------------------------------------------------------------------------------------
# Broken packages: our one-line errors, from mlx_lm.load and from mlx-lm's CLI


@pytest.fixture
def tiny_package(tmp_path) -> Path:
    return make_package(tmp_path / "pkg", tokenizer=True)[0]


@pytest.mark.parametrize(
    "how",
    [
        "truncated shard",
        "header one byte short",
        "broken tokenizer_config.json",
        "no manifest",
        "no config.json",
        "no tokenizer",
    ],
)
def test_mlx_lm_load_of_broken_package_raises_package_error(mlx_lm, tiny_package, how):
    from bitnest_mlx.formats.bitnest import PackageError

    named, phrase = break_package(tiny_package, how)
    with pytest.raises(PackageError) as e:
        mlx_lm.load(str(tiny_package))
    message = str(e.value)
    assert "\n" not in message and named in message and phrase in message


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "hi", "--max-tokens", "4"],
        ["chat", "--max-tokens", "4"],
        ["server", "--host", "127.0.0.1", "--port", "0"],  # must fail before it listens
    ],
    ids=lambda c: c[0],
)
def test_mlx_lm_cli_on_broken_package_is_one_line_and_exit_2(tiny_package, tmp_path, command):
    named, _ = break_package(tiny_package, "truncated shard")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm", command[0], "--model", str(tiny_package), *command[1:]],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], out.stderr


# ---------------------------------------------------------------------------------------------
# The prompt cache after a speculative stream, as mlx-lm's server reuses it


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5, None])
def test_speculative_stream_leaves_cache_at_prompt_plus_yielded_tokens(mlx_lm, package, stop_after):
    """mlx-lm's server keys a saved cache by prompt + yielded tokens and trims it by that count:
    the shared-cache loop must leave exactly those positions, however the consumer stops."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = mlx_lm.load(package)
    draft, _ = mlx_lm.load(package + "#draft")
    prompt = tokenizer.encode("The river runs slowly through the")
    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    got = []
    for r in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=8, draft_model=draft, prompt_cache=cache
    ):
        got.append(r.token)
        if len(got) == stop_after:
            break
    assert cache[0].offset == len(prompt) + len(got)


def test_server_style_cache_reuse_matches_a_fresh_run(mlx_lm, package):
    """LRUPromptCache as mlx_lm.server uses it, after an abandoned stream: same tokens, same
    log-probabilities as a run without a cache."""
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    model, tokenizer = mlx_lm.load(package)
    draft, _ = mlx_lm.load(package + "#draft")
    prompt = tokenizer.encode("The mill has not turned")

    def run(lru, stop_after=None, max_tokens=8):
        key = prompt[:]
        cache, rest = lru.fetch_nearest_cache("m", key) if lru else (None, prompt)
        cache = cache or make_prompt_cache(model)
        out = []
        for r in mlx_lm.stream_generate(
            model, tokenizer, rest, max_tokens=max_tokens, draft_model=draft, prompt_cache=cache
        ):
            out.append((r.token, r.logprobs[r.token].item()))
            key.append(r.token)
            if len(out) == stop_after:
                break
        if lru is not None:
            lru.insert_cache("m", key, cache)
        return out

    fresh = run(None)
    lru = LRUPromptCache(4)
    assert run(lru) == fresh
    run(lru, stop_after=2, max_tokens=64)  # a client that went away mid-stream
    again = run(lru)
    assert [t for t, _ in again] == [t for t, _ in fresh]
    assert max(abs(a - b) for (_, a), (_, b) in zip(again, fresh)) < 1e-4
