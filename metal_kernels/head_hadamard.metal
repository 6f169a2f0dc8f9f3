// R3: every head row of q and of k times the normalized Walsh-Hadamard matrix (natural order,
// H[i, j] = (-1)^popcount(i & j), over √D), in float32, written back in each one's dtype.
// Template: D (head_dim, a power of two from 32 to 1024), TQ and TK (the outputs' dtypes).
// One simdgroup per row (the q rows first, then k's): lane l holds columns l·V .. l·V + V - 1,
// V = D / 32. Butterflies of span h < V stay in a lane; wider ones pair lane l with l ^ (h / V).
constexpr int V = D / 32;
const int lane = int(thread_index_in_simdgroup);
const int row = int(thread_position_in_grid.y);
const bool is_q = row < rows_q;
const int at = (is_q ? row : row - rows_q) * D + lane * V;
float x[V];
BN_UNROLL
for (int j = 0; j < V; j++)
  x[j] = float(is_q ? q[at + j] : k[at + j]);
BN_UNROLL
for (int h = 1; h < V; h *= 2) {
  BN_UNROLL
  for (int j = 0; j < V; j++)
    if ((j & h) == 0) {
      const float a = x[j], b = x[j + h];
      x[j] = a + b;
      x[j + h] = a - b;
    }
}
for (int h = V; h < D; h *= 2) {
  const ushort partner = ushort(h / V);
  const bool upper = (lane & (h / V)) != 0;
  BN_UNROLL
  for (int j = 0; j < V; j++) {
    const float other = metal::simd_shuffle_xor(x[j], partner);
    x[j] = upper ? other - x[j] : x[j] + other;
  }
}
const float norm = metal::rsqrt(float(D));
BN_UNROLL
for (int j = 0; j < V; j++) {
  if (is_q)
    q_out[at + j] = TQ(x[j] * norm);
  else
    k_out[at + j] = TK(x[j] * norm);
}
