// Page transfers between the device KV pool (L1) and the pinned host KV pool (L2).
//
// No #include: NVRTC (CuPy RawModule) compiles this file as-is, and so does `nvcc --cubin`.
// The wrapper is kernels/transfer_kv.py; its pure-torch reference defines the semantics.
//
// Unit of work: one *chunk* = one page of one layer's K or V = page_size * kv_heads * head_dim
// elements, contiguous on both sides:
//
//   device  layer l, K:  k_ptrs[l] + device_page * chunk_bytes    (k_buffers[l] is
//                                                                   [num_slots, kv_heads, head_dim])
//   host    (page, l, kv): host_base + host_page * host_page_stride
//                                    + l * host_layer_stride + kv * host_kv_stride
//
// The host strides are byte strides of the host buffer, so both host layouts work:
//   page_first  [P, L, 2, S, H, D]: page = L*2*chunk, layer = 2*chunk, kv = chunk
//   layer_first [L, 2, P, S, H, D]: page = chunk,     layer = 2*P*chunk, kv = P*chunk
//
// The host buffer is pinned memory that the GPU reads and writes directly through UVA, so one
// launch moves every chunk with no staging copy. Chunks are independent (the wrapper rejects
// duplicate destination pages), so one warp copies one chunk and warps stride over chunks.

typedef unsigned long long u64;
typedef long long i64;

#define WARP_SIZE 32
// 16-byte vectors in flight per lane before the first store: hides PCIe / C2C latency.
#define VEC_UNROLL 4

// Copy `bytes` from src to dst with the 32 lanes of a warp: 16-byte vectors when both
// addresses and the size are 16-byte aligned, else 4-byte words, else single bytes.
__device__ __forceinline__ void warp_copy(unsigned char* dst, const unsigned char* src, i64 bytes,
                                          int lane) {
  const u64 bits = reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src) |
                   static_cast<u64>(bytes);
  if ((bits & 15) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    const i64 n = bytes >> 4;
    i64 i = lane;
    for (; i + (VEC_UNROLL - 1) * WARP_SIZE < n; i += VEC_UNROLL * WARP_SIZE) {
      int4 r[VEC_UNROLL];
#pragma unroll
      for (int u = 0; u < VEC_UNROLL; ++u) r[u] = s[i + u * WARP_SIZE];
#pragma unroll
      for (int u = 0; u < VEC_UNROLL; ++u) d[i + u * WARP_SIZE] = r[u];
    }
    for (; i < n; i += WARP_SIZE) d[i] = s[i];
  } else if ((bits & 3) == 0) {
    const unsigned int* s = reinterpret_cast<const unsigned int*>(src);
    unsigned int* d = reinterpret_cast<unsigned int*>(dst);
    const i64 n = bytes >> 2;
    for (i64 i = lane; i < n; i += WARP_SIZE) d[i] = s[i];
  } else {
    for (i64 i = lane; i < bytes; i += WARP_SIZE) dst[i] = src[i];
  }
}

// Addresses of chunk `c`. Chunks are numbered page-major, then layer, then K/V, so that
// neighbouring warps touch neighbouring host bytes in the page_first layout.
struct ChunkAddr {
  unsigned char* device;
  unsigned char* host;
};

__device__ __forceinline__ ChunkAddr chunk_addr(
    i64 c, const u64* k_ptrs, const u64* v_ptrs, const i64* layer_ids, i64 first_layer,
    i64 num_sel_layers, const i64* device_pages, const i64* host_pages, u64 host_base,
    i64 chunk_bytes, i64 host_page_stride, i64 host_layer_stride, i64 host_kv_stride) {
  const int kv = static_cast<int>(c & 1);
  const i64 rest = c >> 1;
  const i64 sel = rest % num_sel_layers;
  const i64 p = rest / num_sel_layers;
  // layer_ids == nullptr: the selected layers are first_layer, first_layer + 1, ...
  const i64 layer = layer_ids != nullptr ? layer_ids[sel] : first_layer + sel;
  const u64 device_base = kv == 0 ? k_ptrs[layer] : v_ptrs[layer];
  ChunkAddr a;
  a.device = reinterpret_cast<unsigned char*>(device_base + device_pages[p] * chunk_bytes);
  a.host = reinterpret_cast<unsigned char*>(host_base + host_pages[p] * host_page_stride +
                                            layer * host_layer_stride + kv * host_kv_stride);
  return a;
}

// Both directions: one warp per chunk (a page of one layer's K or V), grid-stride.
template <bool TO_HOST>
__device__ __forceinline__ void copy_chunks(
    const u64* k_ptrs, const u64* v_ptrs,
    const i64* layer_ids, i64 first_layer, i64 num_sel_layers,
    const i64* device_pages, const i64* host_pages, i64 num_pages,
    u64 host_base, i64 chunk_bytes,
    i64 host_page_stride, i64 host_layer_stride, i64 host_kv_stride) {
  const int lane = threadIdx.x & (WARP_SIZE - 1);
  const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) / WARP_SIZE;
  const i64 num_warps = static_cast<i64>(gridDim.x) * blockDim.x / WARP_SIZE;
  const i64 num_chunks = num_pages * num_sel_layers * 2;
  for (i64 c = warp; c < num_chunks; c += num_warps) {
    const ChunkAddr a = chunk_addr(c, k_ptrs, v_ptrs, layer_ids, first_layer, num_sel_layers,
                                   device_pages, host_pages, host_base, chunk_bytes,
                                   host_page_stride, host_layer_stride, host_kv_stride);
    if (TO_HOST) {
      warp_copy(a.host, a.device, chunk_bytes, lane);
    } else {
      warp_copy(a.device, a.host, chunk_bytes, lane);
    }
  }
}

// D->H: copy num_pages pages of the selected layers, K and V, from the device pool into the
// pinned host pool. device_pages[i] lands in host_pages[i].
extern "C" __global__ void gather_kv_d2h(
    const u64* k_ptrs, const u64* v_ptrs,           // [num_layers] device addresses per layer
    const i64* layer_ids, i64 first_layer, i64 num_sel_layers,
    const i64* device_pages, const i64* host_pages, i64 num_pages,
    u64 host_base, i64 chunk_bytes,
    i64 host_page_stride, i64 host_layer_stride, i64 host_kv_stride) {
  copy_chunks<true>(k_ptrs, v_ptrs, layer_ids, first_layer, num_sel_layers, device_pages,
                    host_pages, num_pages, host_base, chunk_bytes, host_page_stride,
                    host_layer_stride, host_kv_stride);
}

// H->D: the reverse, same arguments. The wrapper launches it once per layer
// (num_sel_layers == 1) so that layer i can be waited on while layer i + 1 is in flight.
extern "C" __global__ void scatter_kv_h2d(
    const u64* k_ptrs, const u64* v_ptrs,
    const i64* layer_ids, i64 first_layer, i64 num_sel_layers,
    const i64* device_pages, const i64* host_pages, i64 num_pages,
    u64 host_base, i64 chunk_bytes,
    i64 host_page_stride, i64 host_layer_stride, i64 host_kv_stride) {
  copy_chunks<false>(k_ptrs, v_ptrs, layer_ids, first_layer, num_sel_layers, device_pages,
                     host_pages, num_pages, host_base, chunk_bytes, host_page_stride,
                     host_layer_stride, host_kv_stride);
}
