"""What bitnest_mlx relies on in mlx-lm, checked against the installed mlx-lm: an upgrade that
moves a patched function, renames a parameter, adds a server flag or changes a base method that
bitnest-server overrides fails here, by name, instead of in a user's session."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

import mlx_lm.chat
import mlx_lm.models.cache
import mlx_lm.server as mlx_server
import mlx_lm.utils
import pytest

from bitnest_mlx.cli import server
from bitnest_mlx.mlx_lm_integration import plugin, serving

# `mlx_lm.generate` the attribute is the function mlx_lm/__init__ exports; this is the module.
generate_module = importlib.import_module("mlx_lm.generate")


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _mlx_lm_server_args(monkeypatch, argv: list[str]) -> argparse.Namespace:
    """The namespace `mlx_lm.server.main` builds from `argv` (its parser lives inside main)."""
    seen = []
    monkeypatch.setattr(sys, "argv", ["mlx_lm.server", *argv])
    monkeypatch.setattr(mlx_server, "run", lambda host, port, provider: seen.append(provider))
    monkeypatch.setattr(mlx_server, "ModelProvider", lambda args: args)
    monkeypatch.setattr(mlx_server, "maybe_set_recommended_wired_limit", lambda: None)
    mlx_server.main()
    return seen[0]


ARGVS = (
    ["--model", "m"],
    [
        "--model", "m", "--draft-model", "d", "--allowed-origins", "a,b", "--temp", "0.5",
        "--chat-template-args", '{"x": 1}', "--prompt-cache-bytes", "2GB", "--kv-bits", "4",
        "--pipeline", "--log-level", "DEBUG", "--num-draft-tokens", "5",
    ],
)  # fmt: skip


@pytest.mark.parametrize("argv", ARGVS, ids=["defaults", "every-kind-of-flag"])
def test_bitnest_server_parses_every_mlx_lm_server_flag_as_mlx_lm_does(monkeypatch, argv):
    theirs = vars(_mlx_lm_server_args(monkeypatch, argv))
    ours = vars(server.build_parser().parse_args(argv))
    assert {k: v for k, v in ours.items() if k not in server.OURS} == theirs


def test_server_base_methods_bitnest_server_overrides_keep_their_signatures():
    overridden = {
        (mlx_server.ModelProvider, serving.Provider): ("__init__", "load_default", "load"),
        (mlx_server.ResponseGenerator, serving.Generator): ("_tokenize",),
        (mlx_server.APIHandler, serving.Handler): (
            "handle",
            "end_headers",
            "_set_completion_headers",
            "do_POST",
            "validate_model_parameters",
            "handle_models_request",
        ),
    }
    for (base, ours), names in overridden.items():
        for name in names:
            assert name in vars(ours), f"{ours.__name__} no longer overrides {name}"
            assert hasattr(base, name), f"{base.__name__}.{name} is gone"
    assert _params(mlx_server.ModelProvider.__init__) == ["self", "cli_args"]
    assert _params(mlx_server.ModelProvider.load)[:4] == [
        "self", "model_path", "adapter_path", "draft_model_path"
    ]  # fmt: skip
    assert _params(mlx_server.ResponseGenerator.__init__)[:3] == [
        "self", "model_provider", "prompt_cache"
    ]  # fmt: skip
    assert _params(mlx_server.ResponseGenerator._tokenize)[1:] == ["tokenizer", "request", "args"]
    assert "system_fingerprint" in _params(mlx_server.APIHandler.__init__)
    assert _params(mlx_server.APIHandler._set_completion_headers)[1:] == ["status_code"]
    # The handler's request fields ours validates, set by mlx-lm before validation.
    source = inspect.getsource(mlx_server.APIHandler)
    for field in ("requested_model", "requested_draft_model", "adapter", "stream_options"):
        assert f"self.{field} =" in source, field
    assert callable(mlx_server.get_system_fingerprint) and callable(mlx_server._image_parts)


def test_every_patch_target_still_has_the_shape_its_patch_assumes():
    utils, generate = mlx_lm.utils, generate_module
    assert _params(utils.load_model)[:4] == ["model_path", "lazy", "strict", "model_config"]
    assert _params(utils.load_tokenizer)[:2] == ["model_path", "tokenizer_config_extra"]
    assert _params(utils.load)[0] == "path_or_hf_repo" and "return_config" in _params(utils.load)
    step = _params(generate.speculative_generate_step)
    assert step[:3] == ["prompt", "model", "draft_model"]
    # stream_generate must look the loop up at call time (a module global), or ours is skipped.
    assert "speculative_generate_step" in generate.stream_generate.__code__.co_names
    # load_prompt_cache resolves saved class names in its module's globals (our cache is added).
    assert "globals()[" in inspect.getsource(mlx_lm.models.cache.load_prompt_cache)
    for module in (generate, mlx_lm.chat, mlx_server):
        assert callable(module.main)
    assert callable(mlx_server.ModelProvider.load_default)


def test_every_patch_is_applied_once_mlx_lm_is_imported():
    plugin.register()
    for fn in (
        mlx_lm.utils.load,
        mlx_lm.utils.load_model,
        mlx_lm.utils.load_tokenizer,
        generate_module.speculative_generate_step,
        generate_module.main,
        mlx_lm.chat.main,
        mlx_server.main,
        mlx_server.ModelProvider.__init__,
    ):
        assert plugin._patched(fn), fn.__qualname__
    assert set(plugin.PATCHES) == {
        "mlx_lm.utils", "mlx_lm.generate", "mlx_lm.chat", "mlx_lm.server"
    }  # fmt: skip


def test_bitnest_server_swaps_nothing_in_mlx_lm_or_sys():
    """cli/ composes mlx-lm's classes: no sys.argv or module attribute is assigned there."""
    import ast
    from pathlib import Path

    for f in Path(server.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                            assert sub.value.id not in ("sys", "mlx_server", "mlx_lm"), (
                                f"{f.name}:{node.lineno} assigns {sub.value.id}.{sub.attr}"
                            )
