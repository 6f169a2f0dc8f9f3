"""Defaults of the converter that are choices about the package it writes, with their reasons."""

from __future__ import annotations

# Weight columns per scale, the largest of 64 and 32 dividing every Linear input (`--group-size`
# overrides). The draft's W4 grid is the speculation's lever (examples/real_model.md, "The
# draft's grid"): on Qwen2.5-Coder-0.5B, 64 against 128 cuts the draft's perplexity 7 % and
# raises Σmin(p, q) by 0.013 for 1/8 bit per weight more on both planes; 32 gains the draft more
# again (SmolLM2-135M: −13 % against 64) but puts SmolLM2's target 1.5 % above float, outside
# the target's 1 % bound. Packages of 128 (the seed's,
# formats/bitnest SEED_GROUP_SIZE) keep loading unchanged.
DEFAULT_GROUP_SIZE = 64
