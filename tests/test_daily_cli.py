"""What a daily user of the commands runs into: Ctrl-C, a closed stdout, `python -m bitnest_mlx
CMD`, `--prompt -`, the context cap, mlx-lm's generate flags, `load("demo")`, the default mode on
this hardware, and the chat command (on the demo, whose shipped template makes it chat)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import types

import mlx.core as mx
import pytest

import bitnest_mlx
from bitnest_mlx.cli import chat, entry, generate
from bitnest_mlx.cli.args import default_mode
from bitnest_mlx.runtime.demo import demo_path

# The reports' kernels from the stored table (conftest.stored_kernels): not what these test.
pytestmark = pytest.mark.usefixtures("stored_kernels")

LONG = ["--max-tokens", "1000", "--temp", "1.0", "--ignore-chat-template"]  # 300+ tokens, seed 0


def _interruptible() -> None:
    # A child of a background job inherits SIGINT ignored (POSIX), and then Python never turns
    # it into KeyboardInterrupt; a user's terminal delivers it with the default disposition.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interruptible,
        **kw,
    )


def test_ctrl_c_while_generating_exits_130_with_one_line():
    proc = start("bitnest_mlx.generate", *LONG)
    assert proc.stdout.read(1)  # the first text has streamed: generation is under way
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "bitnest-generate: interrupted"
    assert "Traceback" not in err


def test_ctrl_c_during_the_imports_or_the_work_of_any_command_is_one_line(monkeypatch, capsys):
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(entry.importlib, "import_module", interrupted)
    assert entry.run("eval", []) == 130
    fake = types.SimpleNamespace(main=lambda argv: (_ for _ in ()).throw(KeyboardInterrupt()))
    monkeypatch.setattr(entry.importlib, "import_module", lambda name: fake)
    assert entry.run("bench", []) == 130
    err = capsys.readouterr().err.splitlines()
    assert err == ["bitnest-eval: interrupted", "bitnest-bench: interrupted"]


def test_a_closed_stdout_ends_generate_quietly():
    proc = start("bitnest_mlx.generate", *LONG)
    assert proc.stdout.readline()
    proc.stdout.close()  # `| head -1`
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_python_m_bitnest_mlx_dispatches_a_command_with_its_arguments(capsys):
    assert entry.dispatch(["generate", "--help"]) == "bitnest_mlx.generate"
    assert entry.dispatch(["generat"]) == 2
    assert "unknown command 'generat'" in capsys.readouterr().err
    r = subprocess.run(
        [sys.executable, "-m", "bitnest_mlx", "verify", str(demo_path())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "ok" in r.stdout.lower(), r.stdout + r.stderr


def run(capsys, module, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = module.main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_prompt_dash_reads_stdin(monkeypatch, capsys):
    common = ("--max-tokens", "6", "--temp", "0", "--json")
    _, given, _ = run(capsys, generate, "--prompt", "The river", *common)
    monkeypatch.setattr(sys, "stdin", io.StringIO("The river"))
    code, piped, _ = run(capsys, generate, "--prompt", "-", *common)
    assert code == 0 and json.loads(piped)["tokens"] == json.loads(given)["tokens"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = run(capsys, generate, "--prompt", "-", *common)
    assert code == 2 and "prompt read from stdin is empty" in err


def test_a_prompt_near_the_context_caps_max_tokens_with_a_note(monkeypatch, capsys):
    model, tokenizer = bitnest_mlx.load("demo")
    context = model.args.max_position_embeddings
    unit = len(tokenizer.encode(" river" * 10)) // 10
    text = " river" * ((context - 4) // unit)
    n = len(tokenizer.encode(text))
    assert context - 10 < n < context
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    argv = ("--prompt", "-", "--ignore-chat-template", "--max-tokens", "50", "--json")
    code, out, err = run(capsys, generate, *argv, "--mode", "target")
    assert code == 0 and len(json.loads(out)["tokens"]) <= context - n
    assert f"--max-tokens 50 capped at {context - n}: the prompt's {n} tokens" in err


def test_load_demo_names_the_shipped_demo():
    model, tokenizer = bitnest_mlx.load("demo")
    assert model.supports_draft and tokenizer.has_chat_template


def test_an_empty_prompt_is_refused_by_the_api_with_a_clear_error():
    model, tokenizer = bitnest_mlx.load("demo")
    with pytest.raises(ValueError, match="the prompt is empty"):
        bitnest_mlx.generate(model, tokenizer, [])


def test_extra_eos_token_ends_generation_at_that_token(capsys):
    common = ("--max-tokens", "12", "--temp", "0", "--json", "--mode", "target")
    _, out, _ = run(capsys, generate, *common)
    tokens = json.loads(out)["tokens"]
    _, tokenizer = bitnest_mlx.load("demo")
    stop = tokenizer.convert_ids_to_tokens(tokens[4])
    first = tokens.index(tokens[4])
    code, out, _ = run(capsys, generate, *common, "--extra-eos-token", stop)
    assert code == 0 and json.loads(out)["tokens"] == tokens[:first]


def test_verbose_false_prints_the_text_only(capsys):
    code, out, err = run(capsys, generate, "--max-tokens", "4", "--verbose", "false")
    assert code == 0 and out.strip() and err == ""
    code, _, err = run(capsys, generate, "--max-tokens", "4", "--verbose", "maybe")
    assert code == 2 and "expected true or false" in err


def test_chat_template_config_reaches_the_template_and_bad_json_is_one_line(monkeypatch, capsys):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    seen = {}
    original = TokenizerWrapper.apply_chat_template

    def spy(self, messages, **kw):
        seen.update(kw)
        return original(self, messages, **kw)

    monkeypatch.setattr(TokenizerWrapper, "apply_chat_template", spy, raising=False)
    config = '{"enable_thinking": false}'
    code, _, _ = run(capsys, generate, "--max-tokens", "2", "--chat-template-config", config)
    assert code == 0 and seen["enable_thinking"] is False
    code, _, err = run(capsys, generate, "--chat-template-config", "{enable")
    assert code == 2 and err.startswith("error: argument --chat-template-config: not JSON")


def test_the_default_mode_is_speculative_on_a_gpu_and_target_on_a_cpu():
    assert default_mode(None, True, mx.Device(mx.gpu)) == ("speculative", "")
    mode, note = default_mode(None, True, mx.Device(mx.cpu))
    assert mode == "target" and note.startswith("[mode] target-only: on a CPU device")
    assert default_mode("speculative", True, mx.Device(mx.cpu)) == ("speculative", "")
    assert default_mode(None, False, mx.Device(mx.gpu)) == ("target", "")


def chat_run(monkeypatch, capsys, lines: str, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    return run(capsys, chat, "--max-tokens", "8", *argv)


def test_chat_replies_per_turn_resets_and_exits_on_piped_input(monkeypatch, capsys):
    turns = "Permission is granted\n/help\nThe river\n/reset\nThe river\n/exit\nnever read\n"
    code, out, err = chat_run(monkeypatch, capsys, turns, "--stats", "--mode", "target")
    assert code == 0
    assert err.count("[target] prompt:") == 3 and "[chat] commands: /reset" in err
    assert "the conversation is reset" in err
    replies = [line for line in err.splitlines() if line.startswith("[target]")]
    # The second turn prefills only what the cache lacks; after /reset the same turn is whole.
    first, second, third = (int(line.split("prompt: ")[1].split()[0]) for line in replies)
    _, tokenizer = bitnest_mlx.load("demo")
    # Fewer than the first turn, its 8-token reply and the new turn: the cache kept a prefix.
    assert second < first + 8 + len(tokenizer.encode("\n\nThe river"))
    fresh = [{"role": "user", "content": "The river"}]
    assert third == len(tokenizer.apply_chat_template(fresh, add_generation_prompt=True))


def test_chat_output_equals_generate_on_the_same_template(monkeypatch, capsys):
    code, out, _ = chat_run(monkeypatch, capsys, "The river\n", "--mode", "target")
    assert code == 0
    _, text, _ = run(capsys, generate, "--prompt", "The river", "--max-tokens", "8", "--temp", "0")
    assert out.strip() == text.strip()


def test_chat_with_the_system_prompt_and_speculation_stays_exact(monkeypatch, capsys):
    args = ("--system-prompt", "Copyright notice.")
    _, target, _ = chat_run(monkeypatch, capsys, "The river\n", *args, "--mode", "target")
    _, spec, err = chat_run(
        monkeypatch, capsys, "The river\n", *args, "--mode", "speculative", "--stats"
    )
    assert spec == target and "[speculative] prompt:" in err


def test_chat_refuses_a_model_without_a_template_in_one_line(tmp_path, monkeypatch, capsys):
    import shutil

    package = tmp_path / "no-template"
    shutil.copytree(demo_path(), package)
    config = json.loads((package / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (package / "tokenizer_config.json").write_text(json.dumps(config))
    code, out, err = chat_run(monkeypatch, capsys, "hi\n", "--model", str(package))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "has no chat template" in err


@pytest.mark.parametrize("which", ["demo package", "DeepSeek-V4 demo bundle"])
def test_a_chat_turn_on_the_kept_cache_equals_the_turn_computed_afresh(which):
    from bitnest_mlx.runtime.demo import demo_bundle_path

    path = demo_path() if which == "demo package" else demo_bundle_path()
    args = chat.build_parser().parse_args(["--model", str(path), "--max-tokens", "8"])
    args.mode = "target"
    model, tokenizer = bitnest_mlx.load(path)

    def reply(conversation, text):
        stats = bitnest_mlx.SpeculativeStats()
        return [r.token for r in conversation.reply(text, stats)]

    kept = chat.Conversation(model, tokenizer, args)
    reply(kept, "Permission is granted")
    second = reply(kept, "The river")
    fresh = chat.Conversation(model, tokenizer, args)
    fresh.messages = kept.messages[:-2]  # the first turn, and no cache
    assert reply(fresh, "The river") == second
    assert fresh.cached[: len(kept.cached)] == kept.cached


def test_mlx_lm_chat_runs_on_the_demo_package():
    r = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "chat", "--model", str(demo_path())]
        + ["--max-tokens", "4"],
        input="Permission is granted\nq\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "4 tokens" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "name", ["generate", "chat", "eval", "bench", "convert", "verify", "doctor"]
)
def test_every_option_taking_a_value_gives_its_default_in_help(name):
    import argparse
    import importlib

    parser = importlib.import_module(f"bitnest_mlx.cli.{name}").build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.required or action.nargs == 0:
            continue
        text = formatter._expand_help(action) if action.help else ""
        assert "default" in text.lower(), (name, action.option_strings, text)
        assert action.help is not argparse.SUPPRESS


def test_the_eval_report_is_sections_of_words_with_each_number_once(tmp_path, capsys):
    from bitnest_mlx.cli import eval as eval_cli

    text = tmp_path / "t.txt"
    text.write_text("The licenses for most software are designed to take away your freedom. " * 8)
    argv = ["--text", str(text), "--max-tokens", "64", "--window", "32", "--gen-tokens", "0"]
    code, out, _ = run(capsys, eval_cli, *argv, "--mode", "target")
    assert code == 0
    assert "{" not in out and "'" not in out  # no Python dict or repr
    assert out.count("ppl ") == 1 + 2  # the target once, then each draft KV reading
    assert out.startswith("eval of demo on ")


def test_max_kv_size_caps_prompt_plus_output_with_a_note(capsys):
    argv = ("--prompt", "The river", "--max-tokens", "40", "--json", "--mode", "target")
    _, out, _ = run(capsys, generate, *argv)
    prompt_tokens = json.loads(out)["stats"]["prompt_tokens"]
    code, out, err = run(capsys, generate, *argv, "--max-kv-size", str(prompt_tokens + 6))
    assert code == 0 and len(json.loads(out)["tokens"]) == 6
    assert (
        f"capped at 6: the prompt's {prompt_tokens} tokens leave that much of --max-kv-size" in err
    )
    code, _, err = run(capsys, generate, *argv, "--max-kv-size", "3")
    assert code == 2 and "holds 3" in err


def test_a_prompt_cache_file_from_mlx_lm_cache_prompt_continues_exactly(tmp_path, capsys):
    cached, query = "Permission is hereby granted, free of charge, to any person", " or entity"
    file = tmp_path / "prefix.safetensors"
    r = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(demo_path())]
        + ["--prompt", cached, "--prompt-cache-file", str(file)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    common = ("--max-tokens", "12", "--temp", "0", "--json")
    _, whole, _ = run(capsys, generate, "--prompt", cached + query, *common)
    for mode in ("target", "speculative"):
        code, out, err = run(
            capsys,
            generate,
            "--prompt-cache-file",
            str(file),
            "--prompt",
            query,
            "--mode",
            mode,
            *common,
        )
        assert code == 0, err
        assert json.loads(out)["tokens"] == json.loads(whole)["tokens"], mode
    from bitnest_mlx.runtime.demo import demo_bundle_path

    code, _, err = run(
        capsys, generate, "--model", str(demo_bundle_path()), "--prompt-cache-file", str(file)
    )
    assert code == 2 and "DeepSeek-V4 bundle" in err
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    code, _, err = run(capsys, generate, "--prompt-cache-file", str(tmp_path / "junk.safetensors"))
    assert code == 2 and "not a prompt-cache file" in err and err.count("\n") == 1


def test_eval_reports_progress_of_each_stage_to_its_callback():
    from bitnest_mlx.measurement.evaluation import evaluate

    model, tokenizer = bitnest_mlx.load("demo")
    seen: list[tuple[str, int, int]] = []
    text = "The licenses for most software are designed to take away your freedom. " * 8
    evaluate(
        model,
        tokenizer,
        text,
        max_tokens=64,
        window=32,
        gammas=(2,),
        gen_tokens=4,
        progress=lambda *a: seen.append(a),
    )
    windows = [(done, total) for stage, done, total in seen if stage == "scoring windows"]
    total = windows[0][1]
    assert windows == [(i, total) for i in range(total + 1)]  # each window, then done
    runs = [done for stage, done, _ in seen if stage == "speculative runs"]
    assert runs == [0, 1, 2]


def test_generate_json_shows_a_progress_bar_only_on_a_terminal(capsys):
    code, out, err = run(capsys, generate, "--max-tokens", "3", "--json", "--mode", "target")
    assert code == 0 and "tok/s]" not in err  # stderr is not a terminal here: no bar
