// Paged decode attention: one query token per sequence, K/V read through a slot table.
//
// No #include: NVRTC (CuPy RawModule) compiles this file as-is, and so does `nvcc --cubin`.
// The wrapper is kernels/paged_attention.py; its pure-torch reference defines the semantics:
//
//   out[s, h] = softmax_j(cap(scale * q[s, h] . K[slot(s, j), kvh])) @ V[slot(s, j), kvh]
//   cap(x) = softcap * tanh(x / softcap)       (Gemma 2's attention logit soft-capping;
//                                               softcap 0: cap(x) = x)
//   slot(s, j) = slot_table[s * max_len + j]   for first(s) <= j < seq_lens[s]
//   first(s) = max(0, seq_lens[s] - window)    (a sliding-window layer's W latest keys;
//                                               window 0: every key, first(s) = 0)
//   kvh = h / (num_heads / num_kv_heads)        (GQA: consecutive heads share a KV head)
//
// Layouts (all contiguous): q, out [S, H, D]; k_cache, v_cache [num_slots, KVH, D];
// slot_table [S, max_len] int64; seq_lens [S] int64. Slot table entries outside
// [first(s), seq_lens[s]) and every slot not listed are never read (they may hold garbage or
// NaN).
//
// One block per (head, sequence), THREADS threads. Keys from first(s) on are processed in
// tiles of TILE:
//   1. scores: each warp takes keys of the tile, its lanes stride over D; shuffle reduce;
//      soft-capped by the lane that stores it
//   2. online softmax: running max m and sum l are identical in every thread (each thread
//      reduces the tile from shared memory), so no broadcast is needed
//   3. P @ V: thread t owns output dims t, t + THREADS, ... and accumulates in fp32 registers
// A sequence of length 0 writes zeros.

typedef long long i64;
typedef unsigned short u16;

#define THREADS 128
#define WARP_SIZE 32
#define NUM_WARPS (THREADS / WARP_SIZE)
#define TILE 64
#define MAX_HEAD_DIM 256
#define DIMS_PER_THREAD (MAX_HEAD_DIM / THREADS)
#define NEG_INF __int_as_float(0xff800000)  // -inf without math.h's INFINITY

// ---- element conversions without cuda_fp16.h / cuda_bf16.h (NVRTC has no include path) ----

__device__ __forceinline__ float to_float(float x) { return x; }

struct half_bits { u16 x; };
struct bf16_bits { u16 x; };

__device__ __forceinline__ float to_float(half_bits h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x));
  return f;
}

__device__ __forceinline__ float to_float(bf16_bits b) {
  return __uint_as_float(static_cast<unsigned int>(b.x) << 16);
}

__device__ __forceinline__ void store(float* p, float f) { *p = f; }

__device__ __forceinline__ void store(half_bits* p, float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  p->x = h;
}

__device__ __forceinline__ void store(bf16_bits* p, float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a quiet NaN
    p->x = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  p->x = static_cast<u16>(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = WARP_SIZE / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <typename T>
__device__ void paged_decode(const T* __restrict__ q, const T* __restrict__ k_cache,
                             const T* __restrict__ v_cache, const i64* __restrict__ slot_table,
                             const i64* __restrict__ seq_lens, T* __restrict__ out,
                             int num_heads, int num_kv_heads, int head_dim, i64 max_len,
                             float scale, i64 window, float softcap) {
  const int head = blockIdx.x;
  const i64 seq = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid % WARP_SIZE;
  const int warp = tid / WARP_SIZE;
  const int kv_head = head / (num_heads / num_kv_heads);
  const i64 len = seq_lens[seq];
  const i64 first = window > 0 && len > window ? len - window : 0;
  const i64* slots = slot_table + seq * max_len;
  const i64 token_stride = static_cast<i64>(num_kv_heads) * head_dim;

  __shared__ float s_q[MAX_HEAD_DIM];
  __shared__ float s_score[TILE];
  __shared__ float s_p[TILE];
  __shared__ i64 s_slot[TILE];

  const T* q_row = q + (seq * num_heads + head) * head_dim;
  for (int d = tid; d < head_dim; d += THREADS) s_q[d] = to_float(q_row[d]) * scale;

  float m = NEG_INF;  // running max of the scores seen so far
  float l = 0.0f;       // running sum of exp(score - m)
  float acc[DIMS_PER_THREAD];
#pragma unroll
  for (int i = 0; i < DIMS_PER_THREAD; ++i) acc[i] = 0.0f;
  __syncthreads();

  for (i64 start = first; start < len; start += TILE) {
    const int n = static_cast<int>(len - start < TILE ? len - start : TILE);
    // 1. scores of keys start .. start + n - 1
    for (int j = warp; j < n; j += NUM_WARPS) {
      const i64 slot = slots[start + j];
      const T* k_row = k_cache + slot * token_stride + static_cast<i64>(kv_head) * head_dim;
      float dot = 0.0f;
      for (int d = lane; d < head_dim; d += WARP_SIZE) dot += s_q[d] * to_float(k_row[d]);
      dot = warp_sum(dot);
      if (lane == 0) {
        s_score[j] = softcap > 0.0f ? tanhf(dot / softcap) * softcap : dot;
        s_slot[j] = slot;
      }
    }
    __syncthreads();
    // 2. online softmax update, the same in every thread
    float tile_max = NEG_INF;
    for (int j = 0; j < n; ++j) tile_max = fmaxf(tile_max, s_score[j]);
    const float m_new = fmaxf(m, tile_max);
    const float alpha = expf(m - m_new);  // 0 on the first tile (m = -inf)
    for (int j = tid; j < n; j += THREADS) s_p[j] = expf(s_score[j] - m_new);
    __syncthreads();
    float tile_sum = 0.0f;
    for (int j = 0; j < n; ++j) tile_sum += s_p[j];
    l = l * alpha + tile_sum;
    m = m_new;
    // 3. acc = acc * alpha + P @ V over this tile
#pragma unroll
    for (int i = 0; i < DIMS_PER_THREAD; ++i) {
      const int d = tid + i * THREADS;
      if (d < head_dim) {
        float a = acc[i] * alpha;
        for (int j = 0; j < n; ++j) {
          const T* v_row =
              v_cache + s_slot[j] * token_stride + static_cast<i64>(kv_head) * head_dim;
          a += s_p[j] * to_float(v_row[d]);
        }
        acc[i] = a;
      }
    }
    __syncthreads();  // s_score / s_p / s_slot are rewritten by the next tile
  }

  const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
  T* out_row = out + (seq * num_heads + head) * head_dim;
#pragma unroll
  for (int i = 0; i < DIMS_PER_THREAD; ++i) {
    const int d = tid + i * THREADS;
    if (d < head_dim) store(out_row + d, acc[i] * inv_l);
  }
}

#define DEFINE_KERNEL(NAME, T)                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS)                                       \
  NAME(const T* q, const T* k_cache, const T* v_cache, const i64* slot_table,                \
       const i64* seq_lens, T* out, int num_heads, int num_kv_heads, int head_dim,             \
       i64 max_len, float scale, i64 window, float softcap) {                                 \
    paged_decode<T>(q, k_cache, v_cache, slot_table, seq_lens, out, num_heads, num_kv_heads,   \
                    head_dim, max_len, scale, window, softcap);                                \
  }

DEFINE_KERNEL(paged_decode_attention_f32, float)
DEFINE_KERNEL(paged_decode_attention_f16, half_bits)
DEFINE_KERNEL(paged_decode_attention_bf16, bf16_bits)
