// A8 codes of x [M, K], numerics.a8's rule bit for bit: per row and group of G columns (G = K:
// per token), a = max|x| / 127 (1 where max|x| = 0), q = clip(rint(x / a), -128, 127).
// One simdgroup per (row, group): its lanes stride the group's columns, reduce max|x|, then
// write the codes (as floats: the dual-plane kernel's "codes" input) and lane 0 the scale.
const int lane = int(thread_index_in_simdgroup);
const int groups = K / G;
const int row = int(thread_position_in_grid.y) / groups;
const int g = int(thread_position_in_grid.y) % groups;
const int base = row * K + g * G;
float amax = 0.0f;
for (int c = lane; c < G; c += 32)
  amax = metal::max(amax, metal::abs(float(x[base + c])));
amax = metal::simd_max(amax);
const float a = amax == 0.0f ? 1.0f : amax / 127.0f;
for (int c = lane; c < G; c += 32)
  q[base + c] = metal::clamp(metal::rint(float(x[base + c]) / a), -128.0f, 127.0f);
if (lane == 0)
  scale[row * groups + g] = a;
