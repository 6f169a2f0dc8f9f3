"""`--model demo` names the demo package in every command."""

from __future__ import annotations

from bitnest_mlx.demo import demo_path, resolve_model

HELD_OUT = (
    "The intent of this document is to state the conditions under which a Package may be "
    "copied, such that the Copyright Holder maintains some semblance of artistic control over "
    "the development of the package."
)


def test_demo_names_the_demo_package():
    assert resolve_model("demo") == resolve_model(None) == demo_path()
    assert resolve_model("some/dir") == "some/dir"


def test_every_command_takes_model_demo(tmp_path, capsys):
    import json

    from bitnest_mlx.cli import bench, generate
    from bitnest_mlx.cli import eval as eval_cli
    from bitnest_mlx.cli.server import server_argv

    pkg = str(demo_path())
    assert server_argv(["--model", "demo"]) == ["--model", pkg, "--draft-model", pkg + "#draft"]
    assert bench.build_parser().parse_args([]).model == "demo"
    assert generate.main(["--model", "demo", "--max-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["generation_tokens"] == 3
    text = tmp_path / "held_out.txt"
    text.write_text(HELD_OUT)
    argv = ["--text", str(text), "--max-tokens", "32", "--gen-tokens", "0", "--json"]
    assert eval_cli.main(["--model", "demo", *argv]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] > 1
