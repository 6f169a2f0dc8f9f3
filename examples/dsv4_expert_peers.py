"""Routed experts at DeepSeek-V4-Flash shapes without a bundle: MXTQ (the plan of Flash layers
3-4: gate/up 2-bit, down 4-bit; and all-2, all-4) beside mlx-lm's affine 2/4-bit SwitchGLU, as
`bench` reports them (docs/deepseek-v4.md). Usage: python examples/dsv4_expert_peers.py"""

import json
from types import SimpleNamespace

from bitnest_mlx.models.deepseek_v4 import ModelArgs

from bitnest_mlx.formats.dsv4_synthetic import synthetic_config
from bitnest_mlx.measurement import dsv4_bench

config = synthetic_config(2)  # Flash layers 3-4: gate/up 2-bit, down 4-bit
proj = lambda b: SimpleNamespace(bits=b)
layer = SimpleNamespace(
    ffn=SimpleNamespace(
        switch_mlp=SimpleNamespace(gate_proj=proj(2), up_proj=proj(2), down_proj=proj(4))
    )
)
stub = SimpleNamespace(args=ModelArgs.from_dict(config), layers=[layer])
print(json.dumps(dsv4_bench.expert_peers(stub, experts=32, calls=8), indent=1), flush=True)
