"""Publishing a converted package or bundle to the Hugging Face Hub with a model card.

The card (README.md in the folder, as mlx-lm's `upload_to_hub` writes one) says what the model
is, where it came from, how it was converted and how well it scored: the source model, the
converter's settings, the resources of each conversion stage and the quality numbers the
manifest records, plus any `eval --json` results the user passes. The upload is one commit
through `huggingface_hub` (`HfApi.upload_folder`), which honours `HF_ENDPOINT` and `HF_TOKEN`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..formats import detect

MANIFEST = "bitnest.json"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bitnest-mlx")
    except PackageNotFoundError:  # a source tree that was never installed
        return "(source tree)"


CARD = "README.md"


class PublishError(ValueError):
    """A folder that is not a package or bundle, or an eval file that is not eval's JSON."""


def _front_matter(source: str | None, kind: str) -> str:
    lines = ["---", "library_name: mlx", "pipeline_tag: text-generation", "tags:", "- mlx"]
    lines += ["- bitnest", "- self-speculative"] if kind == "bitnest" else ["- deepseek_v4"]
    if source:
        lines.append(f"base_model: {source}")
    return "\n".join([*lines, "---"])


def _hub_source(name: object) -> str | None:
    """A Hub id worth linking (org/name), not a local path."""
    text = str(name or "")
    parts = text.split("/")
    return text if len(parts) == 2 and all(parts) and not text.startswith((".", "~")) else None


def _settings_table(conversion: Mapping) -> list[str]:
    skip = {"per_linear", "resources", "source"}
    rows = [(k, v) for k, v in conversion.items() if k not in skip and not isinstance(v, dict)]
    if not rows:
        return []
    lines = ["## How it was converted", "", "| setting | value |", "|---|---|"]
    lines += [f"| `{k}` | {json.dumps(v)} |" for k, v in rows]
    return [*lines, ""]


def _resources_table(resources: Mapping) -> list[str]:
    stages = resources.get("stages") if isinstance(resources.get("stages"), dict) else resources
    rows = [(k, v) for k, v in stages.items() if isinstance(v, dict)]
    if not rows:
        return []
    lines = ["Conversion stages (wall time, peak resident memory):", ""]
    lines += ["| stage | seconds | peak GB |", "|---|---|---|"]
    for name, v in rows:
        seconds, peak = v.get("seconds", v.get("s")), v.get("peak_gb", v.get("peak_rss_gb"))
        lines.append(f"| {name} | {seconds} | {peak} |")
    return [*lines, ""]


def _quality(conversion: Mapping, manifest: Mapping) -> list[str]:
    per = conversion.get("per_linear") or {}
    lines = ["## Quality recorded at conversion", ""]
    for key, what in (
        ("w4_hessian_err_vs_rtn", "W4 (draft) output error against round-to-nearest"),
        ("w8_hessian_err_vs_rtn", "W8 (target) output error against round-to-nearest"),
    ):
        values = [v[key] for v in per.values() if isinstance(v, dict) and key in v]
        if values:
            lines.append(
                f"- {what}: mean {statistics.fmean(values):.3f}x, worst {max(values):.3f}x "
                f"over {len(values)} Linears (below 1 is better than RTN)"
            )
    for note in ("lm_head_note", "embed_note"):
        if manifest.get(note):
            lines.append(f"- {manifest[note]}")
    draft_vocab = conversion.get("draft_vocab")
    if isinstance(draft_vocab, dict):
        lines.append(f"- draft vocabulary: {json.dumps(draft_vocab)[:300]}")
    return [*lines, ""] if len(lines) > 2 else []


def _eval_section(results: Sequence[Mapping]) -> list[str]:
    lines = []
    for r in results:
        lines += [f"## eval on {Path(str(r.get('text', 'a text'))).name}", ""]
        for mode, s in r.get("modes", {}).items():
            lines.append(f"- {mode}: ppl {s['ppl']:.4f}, {s['bits_per_byte']:.4f} bits/byte")
        if "argmax_agreement" in r:
            lines.append(f"- draft/target greedy agreement: {r['argmax_agreement']:.2%}")
        if "sum_min_pq" in r:
            lines.append(f"- draft/target sum min(p, q): {r['sum_min_pq']:.4f}")
        speed = r.get("speed_model") or {}
        if speed.get("best_speedup_iid") is not None:
            lines.append(
                f"- projected speed-up on a bandwidth-bound GPU (i.i.d.): "
                f"{speed['best_speedup_iid']:.3f}x at gamma {speed['best_gamma_iid']}"
            )
        lines.append("")
    return lines


def model_card(path: Path, repo_id: str, evals: Sequence[Mapping] = ()) -> str:
    """The README.md for a package (or bundle) folder about to be published as `repo_id`."""
    kind = detect(path)
    if kind is None:
        raise PublishError(f"{path}: neither a bitnest package (no {MANIFEST}) nor a bundle")
    manifest = json.loads((path / MANIFEST).read_text()) if kind == "bitnest" else {}
    config = json.loads((path / "config.json").read_text())
    conversion = manifest.get("conversion", {})
    source = _hub_source(manifest.get("source_model") or config.get("_name_or_path"))
    what = (
        "a bitnest package: every weight stored as two nested 4-bit planes, so one set of "
        "weights gives a W4 draft and a W8 target that speculate together (lossless)"
        if kind == "bitnest"
        else "a DeepSeek-V4 MLX bundle with MXTQ-coded routed experts"
    )
    lines = [
        _front_matter(source, kind),
        "",
        f"# {repo_id}",
        "",
        f"This is {what}, made with bitnest-mlx {_version()}"
        + (f" from [{source}](https://huggingface.co/{source})." if source else "."),
        "",
        "## Use",
        "",
        "```bash",
        "pip install bitnest-mlx",
        f"python -m bitnest_mlx.generate --model {repo_id} --prompt 'Hello'",
        f"python -m bitnest_mlx.chat --model {repo_id}",
        "```",
        "",
        f"With bitnest-mlx installed, mlx-lm loads it too: `mlx_lm.generate --model {repo_id}`.",
        "",
    ]
    if kind == "bitnest":
        arch = manifest.get("arch", config.get("model_type"))
        lines += [f"Architecture: {arch}, group size {manifest.get('group_size')}.", ""]
    lines += _settings_table(conversion)
    lines += _resources_table(conversion.get("resources") or {})
    lines += _quality(conversion, manifest)
    lines += _eval_section(evals)
    return "\n".join(lines).rstrip() + "\n"


def read_evals(files: Sequence[str | Path]) -> list[dict]:
    """`eval --json` outputs, checked to be eval's (they have `modes`)."""
    out = []
    for f in files:
        try:
            data = json.loads(Path(f).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PublishError(f"--eval-json {f}: cannot read it as JSON ({e})") from None
        if not isinstance(data, dict) or "modes" not in data:
            raise PublishError(f"--eval-json {f}: not the output of `eval --json` (no 'modes')")
        out.append(data)
    return out


def upload(
    path: str | Path,
    repo_id: str,
    evals: Sequence[Mapping] = (),
    private: bool = False,
    message: str | None = None,
) -> str:
    """Write the model card into `path` and push the folder to `repo_id` (created if missing)
    in one commit; returns the repo's URL."""
    import os

    from huggingface_hub import HfApi

    path = Path(path)
    card = model_card(path, repo_id, evals)
    (path / CARD).write_text(card)
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    url = api.create_repo(repo_id=repo_id, exist_ok=True, private=private, repo_type="model")
    api.upload_folder(
        folder_path=str(path),
        repo_id=repo_id,
        repo_type="model",
        commit_message=message or f"Upload {path.name} (bitnest-mlx {_version()})",
    )
    return str(url)
