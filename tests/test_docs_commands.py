"""The docs cannot go stale: every command of ours in a fenced block of README.md and docs/*.md
uses only flags its parser has, a page's flag table lists exactly its command's flags, and each
block marked `<!-- runnable -->` runs on the demo and prints output of the documented shape
(stats-line format, JSON keys, `error:` lines, a non-generating command's first line)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from bitnest_mlx.cli import (
    COMMANDS,
    bench,
    chat,
    convert,
    doctor,
    eval,
    generate,
    make_bundle,
    server,
    upload,
    verify,
)

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = "<!-- runnable -->"
MAX_TOKENS = 16  # runnable blocks decode at most this many tokens, whatever they document

PARSERS = {
    "generate": generate.build_parser,
    "chat": chat.build_parser,
    "convert": convert.build_parser,
    "eval": eval.build_parser,
    "bench": bench.build_parser,
    "server": server.build_parser,
    "upload": upload.build_parser,
    "verify": verify.build_parser,
    "doctor": doctor.build_parser,
    "dsv4": make_bundle.build_parser,
}
MAINS = {"generate": generate.main, "chat": chat.main, "doctor": doctor.main, "verify": verify.main}
# Example scripts a runnable block may run (`python examples/NAME.py ARGS`): each has main(argv).
RUNNABLE_EXAMPLES = ("server_throughput",)


def example_main(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def runnable_of(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(what MAINS runs, its arguments) for one of our commands or a runnable example script."""
    if len(tokens) > 1 and tokens[0] == "python" and tokens[1].startswith("examples/"):
        name = tokens[1].removeprefix("examples/").removesuffix(".py")
        return (f"examples/{name}", tokens[2:]) if name in RUNNABLE_EXAMPLES else None
    return command_of(tokens)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    runnable: bool

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        body = "\n".join(lines[i + 1 : end])
        found.append(Block(page, i + 1, m.group(1), body, before == RUNNABLE))
        i = end + 1
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page) if b.lang != "python"]


def command_of(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(our command, its arguments) for `python -m bitnest_mlx[.x] ...` / `bitnest-x ...`."""
    if tokens[:2] == ["python", "-m"] and len(tokens) > 2:
        module = tokens[2]
        if module == "bitnest_mlx":
            return "bitnest_mlx", tokens[3:]
        name = module.removeprefix("bitnest_mlx.")
        if module.startswith("bitnest_mlx.") and name.isidentifier():  # not `<name>`
            return name, tokens[3:]
    if tokens and tokens[0].startswith("bitnest-") and tokens[0][8:] in COMMANDS:
        return tokens[0][8:], tokens[1:]
    return None


def commands(block: Block) -> list[tuple[str, list[str], str]]:
    """(command, argv, the line as written) of every invocation of ours in the block."""
    found = []
    for line in block.text.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        for part in re.split(r"&&|;|\|", line):
            try:
                tokens = shlex.split(part, comments=True)
            except ValueError:
                tokens = part.split()
            cmd = command_of(tokens)
            if cmd is not None:
                found.append((*cmd, line))
    return found


def _help_flags(main, argv: list[str]) -> set[str]:
    """The flags `main(argv + ["--help"])` prints: for a subcommand whose parser is built inside
    its `main` (convert's make-checkpoint), in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return set(re.findall(r"(--[\w-]+)", out.getvalue()))


def _flags_of(name: str, argv: list[str]) -> set[str]:
    if name == "convert" and argv[:1] == ["make-checkpoint"]:
        from bitnest_mlx.convert.checkpoint import main as make_checkpoint

        return _help_flags(make_checkpoint, [])
    return set(_parser_for(name, argv)._option_string_actions)


def _parser_for(name: str, argv: list[str]) -> argparse.ArgumentParser:
    parser = PARSERS[name]()
    for action in parser._actions:  # a subcommand's flags live in its own parser
        if isinstance(action, argparse._SubParsersAction) and argv and argv[0] in action.choices:
            return action.choices[argv[0]]
    return parser


INVOCATIONS = [(b, *c) for b in ALL_BLOCKS for c in commands(b)]


def test_the_docs_invoke_our_commands_in_many_places():
    assert len(INVOCATIONS) > 20 and {c for _, c, _, _ in INVOCATIONS} >= {"generate", "server"}


@pytest.mark.parametrize(
    "block, name, argv, line", INVOCATIONS, ids=[f"{b}" for b, *_ in INVOCATIONS]
)
def test_every_documented_flag_exists_in_its_commands_parser(block, name, argv, line):
    if name == "bitnest_mlx":  # `python -m bitnest_mlx CMD ARGS...` runs CMD
        if not argv:
            return
        name, argv = argv[0], argv[1:]
    assert name in PARSERS, f"{block}: no command bitnest_mlx.{name}: {line}"
    options = _flags_of(name, argv)
    for token in argv:
        if token.startswith("--"):
            flag = token.split("=")[0]
            assert flag in options, f"{block}: {name} has no {flag}: {line}"


def flag_tables() -> list[tuple[Path, str, set[str]]]:
    """(page, command, flags listed) of every `| flag |` table on a command's own page."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        title = re.match(r"# `python -m bitnest_mlx\.(\w+)`", text)
        if title is None:
            continue
        for table in re.findall(r"^\| flag \|.*?(?=\n\n|\Z)", text, re.M | re.S):
            firsts = [row.split("|")[1] for row in table.splitlines()[2:]]
            flags = {f for cell in firsts for f in re.findall(r"`(--[\w-]+)", cell)}
            found.append((page, title.group(1), flags))
    return found


@pytest.mark.parametrize(
    "page, name, listed", flag_tables(), ids=[f"{p.name}-{n}" for p, n, _ in flag_tables()]
)
def test_a_commands_flag_table_lists_exactly_its_flags(page, name, listed):
    parser = PARSERS[name]()
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    flags.discard("--help")
    assert listed == flags, (
        f"{page.name}: missing from the table {sorted(flags - listed)}, "
        f"not flags of {name} {sorted(listed - flags)}"
    )


# ------------------------------------------------------------------------- runnable blocks


def piped_input(command: str) -> tuple[str, str | None]:
    """`printf 'a\\nb\\n' | CMD` -> (CMD, "a\\nb\\n"): a runnable block's piped stdin."""
    left, bar, right = command.partition(" | ")
    words = shlex.split(left) if bar else []
    if words[:1] != ["printf"] or len(words) != 2:
        return command, None
    return right, words[1].encode().decode("unicode_escape")


def transcripts(block: Block) -> list[tuple[str, list[str], list[str], str | None]]:
    """(command, argv, documented output lines, stdin) for each `$ command` of a runnable
    block."""
    found: list[tuple[str, list[str], list[str], str | None]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            command, stdin = piped_input(line[2:])
            cmd = runnable_of(shlex.split(command, comments=True))
            runs = cmd is not None and (cmd[0] in MAINS or cmd[0].startswith("examples/"))
            assert runs, f"{block}: cannot run {line}"
            found.append((cmd[0], cmd[1], [], stdin))
        else:
            assert found, f"{block}: a runnable block starts with `$ command`"
            found[-1][2].append(line)
    return found


RUNNABLE_BLOCKS = [b for b in ALL_BLOCKS if b.runnable]


def _short(argv: list[str]) -> list[str]:
    argv = list(argv)
    for flag in ("--max-tokens", "-m"):
        if flag in argv:
            i = argv.index(flag) + 1
            argv[i] = str(min(int(argv[i]), MAX_TOKENS))
    return argv


def _skeleton(line: str) -> str:
    """A stats line's format: numbers and a yes/no verdict stand for any value."""
    line = re.sub(r"\d+(\.\d+)?", "N", line)
    return re.sub(r"fallback: (yes|no)", "fallback: V", line)


def _keys(value) -> object:
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in value.items()}
    return None


def _same_shape(documented: list[str], printed: list[str], name: str, where: str) -> None:
    doc = [line for line in documented if line.strip()]
    if doc and doc[0].lstrip().startswith("{"):
        want = json.loads(" ".join(doc))
        got = json.loads("".join(printed))
        assert _keys(got) == _keys(want), f"{where}: JSON keys differ from the documented ones"
        return
    stats = [_skeleton(x) for x in doc if re.match(r"^\[\w+\] ", x)]
    assert [_skeleton(x) for x in printed if re.match(r"^\[\w+\] ", x)] == stats, where
    errors = [x for x in doc if x.startswith("error: ")]
    assert [x for x in printed if x.startswith("error: ")] == errors, where
    text = [x for x in doc if not re.match(r"^\[\w+\] ", x) and not x.startswith("error: ")]
    if text and name not in ("generate", "chat"):  # generated text varies; labels do not
        assert printed and printed[0] == text[0], where


@pytest.mark.parametrize("block", RUNNABLE_BLOCKS, ids=[str(b) for b in RUNNABLE_BLOCKS])
def test_a_runnable_block_prints_what_it_documents(block, capsys, monkeypatch):
    for name, argv, documented, stdin in transcripts(block):
        if stdin is not None:
            monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        with contextlib.suppress(SystemExit):  # an argument refused: exit 2, as documented
            main = MAINS.get(name) or example_main(name.removeprefix("examples/"))
            main(_short(argv))
        out = capsys.readouterr()
        printed = [x for x in (out.out + out.err).splitlines() if x.strip()]
        _same_shape(documented, printed, name, f"{block}: {name} {' '.join(argv)}")


def test_some_blocks_are_runnable_and_the_stale_examples_are_gone():
    assert len(RUNNABLE_BLOCKS) >= 3
    # The byte-level stand-in the demo replaced printed these; no page may show them again.
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert "the the the" not in text and "[32, 116, 104, 101" not in text, page.name
