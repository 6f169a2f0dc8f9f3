// The nested KV planes of K and V [rows, D] in one launch, by layers/nested_kv.nest_quantize's
// rule: per group of G columns s = max|x| / 7 (1 where it is 0), q4 = clip(rint(x / s), -8, 7),
// qr = clip(rint((x - q4·s) / (s / 16)), -8, 7), each stored as the nibble q + 8 in MLX's 4-bit
// packing (column i of a word at bits 4i), and s as float32.
// One thread per 8-column word of a row of K (z = 0) or V (z = 1). A group's G / 8 threads are
// an aligned run of lanes (a power of two that divides D / 8): its max |x| is their shuffles'.
const int w = int(thread_position_in_grid.x);
const int row = int(thread_position_in_grid.y);
const bool is_v = thread_position_in_grid.z == 1;
const int words = D / 8;
const int per_group = G / 8;
const int at = row * D + w * 8;
float xv[8];
float amax = 0.0f;
for (int i = 0; i < 8; i++) {
  xv[i] = float(is_v ? v[at + i] : k[at + i]);
  amax = metal::max(amax, metal::abs(xv[i]));
}
for (int step = 1; step < per_group; step *= 2)
  amax = metal::max(amax, metal::simd_shuffle_xor(amax, ushort(step)));
const float s = amax == 0.0f ? 1.0f : amax / 7.0f;
const float step_lo = s / 16.0f;  // a power of two below s: exact
uint h = 0, l = 0;
for (int i = 0; i < 8; i++) {
  const float q4 = metal::clamp(metal::rint(xv[i] / s), -8.0f, 7.0f);
  const float coarse = q4 * s;  // rounded apart, as the rule does, before the subtraction
  const float qr = metal::clamp(metal::rint((xv[i] - coarse) / step_lo), -8.0f, 7.0f);
  h |= uint(q4 + 8.0f) << (4 * i);
  l |= uint(qr + 8.0f) << (4 * i);
}
const int word_at = row * words + w;
const int scale_at = row * (D / G) + w / per_group;
const bool writes_scale = w % per_group == 0;
if (is_v) {
  v_hi[word_at] = h;
  v_lo[word_at] = l;
  if (writes_scale)
    v_scales[scale_at] = s;
} else {
  k_hi[word_at] = h;
  k_lo[word_at] = l;
  if (writes_scale)
    k_scales[scale_at] = s;
}
