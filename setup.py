import sys

from setuptools import setup

mlx = "mlx[cpu]>=0.32" if sys.platform.startswith("linux") else "mlx>=0.32"

setup(
    name="bitnest-mlx",
    version="0.1.0",
    description="MLX runtime for nested dual-plane (W4 draft / W8 target) bitnest packages",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        "bitnest_mlx",
        "bitnest_mlx.formats",
        "bitnest_mlx.layers",
        "bitnest_mlx.models",
        "bitnest_mlx.metal_kernels",
    ],
    # models/ and metal_kernels/ live at the top of the repo but install inside the package,
    # so nothing named `models` lands at the top of site-packages.
    package_dir={
        "bitnest_mlx": "bitnest_mlx",
        "bitnest_mlx.models": "models",
        "bitnest_mlx.metal_kernels": "metal_kernels",
    },
    package_data={"bitnest_mlx.metal_kernels": ["*.metal"]},
    install_requires=[
        mlx,
        "mlx-lm>=0.32",
        "numpy",
        "safetensors",
        "huggingface-hub",
        "sentencepiece",
        "tokenizers",
    ],
    extras_require={
        "test": ["pytest", "transformers>=5", "torch==2.13.0", "ruff", "jang==2.5.50", "gguf"],
    },
)
