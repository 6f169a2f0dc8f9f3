// Helpers shared by the bitnest kernels; passed to mx.fast.metal_kernel as `header`.
// MLX scans only the kernel body for attribute names, so nothing here may rely on them.

// Code i (0..7) of a 4-bit word, as MLX's affine packing stores it: low nibble first.
inline int bn_nibble(uint word, int i) {
  return int((word >> (4 * i)) & 0xfu);
}

// A8 code of one activation: clip(round_half_even(x / s), -128, 127), in float32 like the spec.
// Division, not a reciprocal multiply, so ties round exactly as the pure path does.
inline int bn_a8_code(float x, float s) {
  return int(metal::clamp(metal::rint(x / s), -128.0f, 127.0f));
}
