import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = "bitnest_mlx_hook.pth"


class BuildPyWithHook(build_py):
    """Also install bitnest_mlx_hook.pth at the top of site-packages (the mlx-lm plugin hook).

    A wheel's top level is build_lib; an editable wheel is assembled from install_lib instead.
    """

    def run(self):
        super().run()
        top = self.get_finalized_command("install").install_lib if self.editable_mode else None
        self.copy_file(HOOK, os.path.join(top or self.build_lib, HOOK))

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, HOOK)]


mlx = "mlx[cpu]>=0.32" if sys.platform.startswith("linux") else "mlx>=0.32"

setup(
    name="bitnest-mlx",
    version="0.1.0",
    description="MLX runtime for nested dual-plane (W4 draft / W8 target) bitnest packages",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    cmdclass={"build_py": BuildPyWithHook},
    py_modules=["bitnest_mlx_hook"],  # stdlib only: what the .pth imports at every startup
    packages=[
        "bitnest_mlx",
        "bitnest_mlx.cli",
        "bitnest_mlx.convert",
        "bitnest_mlx.formats",
        "bitnest_mlx.formats.bitnest",
        "bitnest_mlx.kernels",
        "bitnest_mlx.kernels.emulator",
        "bitnest_mlx.layers",
        "bitnest_mlx.measurement",
        "bitnest_mlx.mlx_lm_integration",
        "bitnest_mlx.models",
        "bitnest_mlx.runtime",
        "bitnest_mlx.metal_kernels",
    ],
    # models/ and metal_kernels/ live at the top of the repo but install inside the package,
    # so nothing named `models` lands at the top of site-packages.
    package_dir={
        "bitnest_mlx": "bitnest_mlx",
        "bitnest_mlx.models": "models",
        "bitnest_mlx.metal_kernels": "metal_kernels",
    },
    package_data={
        "bitnest_mlx.metal_kernels": ["*.metal"],
        "bitnest_mlx.kernels.emulator": ["*.h"],  # the CPU emulator's C++ runtime
        # the trained demo package (examples/train_demo.py) and the built-in workloads' prompts
        "bitnest_mlx": ["demo_model/*", "workload_data/*.json"],
        "bitnest_mlx.measurement": ["*.json"],  # DeepSeek-V4-Flash's config, priced by dsv4_price
    },
    install_requires=[
        mlx,
        "mlx-lm>=0.32",
        "numpy",
        "safetensors",
        "huggingface-hub",
        "sentencepiece",
        "tokenizers",
        "threadpoolctl",  # the converter's BLAS threads while its workers sweep
        "tqdm",  # progress bars (eval, generate --json); huggingface-hub's own dependency
    ],
    entry_points={
        "console_scripts": [
            f"bitnest-{name}=bitnest_mlx.cli.entry:{name}"
            for name in (
                "generate",
                "chat",
                "convert",
                "eval",
                "bench",
                "server",
                "upload",
                "verify",
                "doctor",
            )
        ]
    },
    extras_require={
        # GGUF input: gguf reads and dequantizes, transformers builds the tokenizer.
        "convert": ["gguf", "transformers>=5"],
        # transformers pinned: the DeepSeek-V4 parity tests compare against its deepseek_v4
        # (absent from earlier 5.x), on the version they were measured with.
        "test": [
            "pytest",
            "pytest-xdist",
            "transformers==5.25.0",
            "torch==2.13.0",
            "ruff",
            "jang==2.5.50",
            "gguf",
        ],
    },
)
