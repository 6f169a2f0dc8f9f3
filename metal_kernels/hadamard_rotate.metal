// MXTQ input rotation y = H_d (signs ⊙ x) / √d for d = 128·E (a power of two up to 4096), float32.
// One threadgroup of 4 simdgroups per row; thread (sg, lane) holds E consecutive elements.
// The log2(d) butterfly stages split by the bit they pair:
//   bits below E         inside the thread's registers,
//   the next 5 bits      lanes of a simdgroup, by simd_shuffle_xor (no memory, no barrier),
//   the top 2 bits       the 4 simdgroups, as one 4-point transform through threadgroup memory
// so a row costs one barrier instead of log2(d) of them.
constexpr int NSG = 4;
constexpr int CHUNK = 32 * E;
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int d = NSG * CHUNK;
const int row = int(threadgroup_position_in_grid.y);
const int base = sg * CHUNK + lane * E;

float v[E];
for (int i = 0; i < E; i++)
  v[i] = float(x[row * d + base + i]) * signs[base + i];
for (int h = 1; h < E; h *= 2) {
  for (int i = 0; i < E; i++) {
    if ((i & h) == 0) {
      const float a = v[i];
      const float b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
  }
}
for (int m = 1; m < 32; m *= 2) {
  const bool upper = (lane & m) != 0;
  for (int i = 0; i < E; i++) {
    const float other = metal::simd_shuffle_xor(v[i], ushort(m));
    v[i] = upper ? other - v[i] : v[i] + other;
  }
}
// Element i of lane l is stored at i·32 + l, not l·E + i: the 32 lanes of one store or load then
// touch 32 consecutive floats (32 banks) instead of every E-th one (an E-way bank conflict).
// Each thread reads back its own (lane, i) slots of the other simdgroups, so only the layout
// changes, not the result.
threadgroup float buf[NSG][CHUNK];
for (int i = 0; i < E; i++)
  buf[sg][i * 32 + lane] = v[i];
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
const float norm = metal::rsqrt(float(d));
for (int i = 0; i < E; i++) {
  float acc = 0.0f;
  for (int s = 0; s < NSG; s++) {
    const float t = buf[s][i * 32 + lane];
    acc += (metal::popcount(uint(sg & s)) & 1u) ? -t : t;
  }
  y[row * d + base + i] = acc * norm;
}
