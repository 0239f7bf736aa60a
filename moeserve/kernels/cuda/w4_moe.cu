// 4-bit grouped MoE GEMM on tensor cores (mma.sync m16n8k16, sm_80+), for 2..64 rows an expert.
//
// The weight is the MMA's A operand (16 output rows a tile), the expert's rows of x its B operand (8 rows an
// n-tile), so a handful of rows per expert wastes nothing on padding. Weights are shuffled once at load
// (w4_layout.py) so that each lane reads its A fragments of one 64-input chunk as one 16-byte load, and the 64
// inputs of a chunk are permuted so that a lane's B fragments are 16 consecutive values of an x row.
// The MMA runs on the exact codes 2^k + q (k = 7 for bf16, 10 for fp16: the magic-number decode, one LOP3 per two
// weights); each chunk's sums are scaled after: s * (sum(code * x) - (z + 2^k) * sum(x)), in fp32 (sum(x) from the
// lanes' fragments by two shuffles). A warp loads its next W4_AHEAD chunks of weights and scales while it multiplies
// the current ones; x comes through L1 (every warp of the expert reads the same rows).
//
// Grid: (tile blocks, experts, K slices). Rows of expert e: [offsets[e-1], offsets[e]) of x (expert-sorted).
// GATE_UP: tiles alternate gate / up (the layout interleaves them), the epilogue writes silu(gate) * up.
// Otherwise the fp32 sums, added atomically when the K range is split.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef W4_WARPS
#define W4_WARPS 4
#endif
#ifndef W4_RT
#define W4_RT 4  // 16-row tiles per warp (even: gate and up tiles pair)
#endif
#ifndef W4_AHEAD
#define W4_AHEAD 2  // 64-input chunks loaded ahead per batch
#endif

template <bool BF16>
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <bool BF16>
__device__ __forceinline__ float pair_sum(uint32_t v) {  // the two 16-bit values of a word, summed in fp32
  if constexpr (BF16) {
    return __uint_as_float(v << 16) + __uint_as_float(v & 0xffff0000u);
  } else {
    float2 f = __half22float2(*reinterpret_cast<__half2*>(&v));
    return f.x + f.y;
  }
}

__device__ __forceinline__ float half_lo(uint32_t v) { return __half2float(__ushort_as_half((unsigned short)(v & 0xffffu))); }
__device__ __forceinline__ float half_hi(uint32_t v) { return __half2float(__ushort_as_half((unsigned short)(v >> 16))); }

template <bool BF16>
__device__ __forceinline__ uint32_t to16x2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// the words and scale/zero of W4_AHEAD chunks from chunk kc (those before kc1) of the warp's W4_RT tiles
__device__ __forceinline__ void load_batch(const uint4* wp, const uint2* sp, size_t wstride, size_t sstride, int kc,
                                           int kc1, int chunks_per_group, uint4 (&w)[W4_AHEAD][W4_RT],
                                           uint2 (&s)[W4_AHEAD][W4_RT]) {
#pragma unroll
  for (int u = 0; u < W4_AHEAD; ++u)
#pragma unroll
    for (int r = 0; r < W4_RT; ++r)
      if (kc + u < kc1) {
        w[u][r] = __ldcs(wp + r * wstride + (size_t)(kc + u) * 32);
        s[u][r] = __ldg(sp + r * sstride + (size_t)((kc + u) / chunks_per_group) * 8);
      }
}

template <int NT, bool GATE_UP, bool BF16>
__device__ __forceinline__ void w4_moe(const uint16_t* __restrict__ x, const uint4* __restrict__ w,
                                       const uint2* __restrict__ sz, void* __restrict__ out,
                                       const int* __restrict__ offsets, int tiles, int chunks, int chunks_per_group,
                                       int groups, int K, int chunks_per_split) {
  constexpr uint32_t MAGIC = BF16 ? 0x43004300u : 0x64006400u;  // 2^7 (bf16) or 2^10 (fp16) in both halves
  constexpr float OFF = BF16 ? 128.0f : 1024.0f;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int e = blockIdx.y;
  const int tile0 = (blockIdx.x * W4_WARPS + warp) * W4_RT;
  if (tile0 >= tiles) return;
  const int start = e ? offsets[e - 1] : 0;
  const int cnt = offsets[e] - start;
  if (cnt <= 0) return;
  const int kc0 = blockIdx.z * chunks_per_split;
  const int kc1 = min(chunks, kc0 + chunks_per_split);
  if (kc0 >= kc1) return;
  const uint4* wp = w + ((size_t)e * tiles + tile0) * chunks * 32 + lane;  // tile r: + r * chunks * 32
  const uint2* sp = sz + ((size_t)e * tiles + tile0) * groups * 8 + g;     // tile r: + r * groups * 8
  const size_t wstride = (size_t)chunks * 32, sstride = (size_t)groups * 8;

  for (int t0 = 0; t0 < cnt; t0 += 8 * NT) {
    float acc[W4_RT][NT][4];
#pragma unroll
    for (int r = 0; r < W4_RT; ++r)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][n][i] = 0.0f;
    const uint4* xp[NT];  // B fragments: row t0 + 8n + g, inputs 16c .. 16c + 15 of each chunk
    bool xok[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int tk = t0 + n * 8 + g;
      xok[n] = tk < cnt;
      xp[n] = reinterpret_cast<const uint4*>(x + (size_t)(start + (xok[n] ? tk : 0)) * K) + 2 * c;
    }

    // weights and scales of the next W4_AHEAD chunks load while this batch multiplies
    uint4 cw[W4_AHEAD][W4_RT];
    uint2 cs[W4_AHEAD][W4_RT];
    load_batch(wp, sp, wstride, sstride, kc0, kc1, chunks_per_group, cw, cs);

    for (int kc = kc0; kc < kc1; kc += W4_AHEAD) {
      uint4 nw[W4_AHEAD][W4_RT];
      uint2 ns[W4_AHEAD][W4_RT];
      load_batch(wp, sp, wstride, sstride, kc + W4_AHEAD, kc1, chunks_per_group, nw, ns);
#pragma unroll
      for (int u = 0; u < W4_AHEAD; ++u) {
        const int k = kc + u;
        if (k < kc1) {
          uint32_t xr[NT][8];
          float xs[NT][2];  // sums over the chunk of this lane's C rows 2c, 2c + 1 of each n-tile
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            uint4 a = make_uint4(0, 0, 0, 0), b = make_uint4(0, 0, 0, 0);
            if (xok[n]) {
              a = __ldg(xp[n] + (size_t)k * 8);
              b = __ldg(xp[n] + (size_t)k * 8 + 1);
            }
            xr[n][0] = a.x; xr[n][1] = a.y; xr[n][2] = a.z; xr[n][3] = a.w;
            xr[n][4] = b.x; xr[n][5] = b.y; xr[n][6] = b.z; xr[n][7] = b.w;
            float p = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) p += pair_sum<BF16>(xr[n][i]);
            p += __shfl_xor_sync(0xffffffffu, p, 1);
            p += __shfl_xor_sync(0xffffffffu, p, 2);  // row g's sum over the chunk
            xs[n][0] = __shfl_sync(0xffffffffu, p, 8 * c);      // row 2c of the n-tile
            xs[n][1] = __shfl_sync(0xffffffffu, p, 8 * c + 4);  // row 2c + 1
          }
#pragma unroll
          for (int r = 0; r < W4_RT; ++r) {
            float part[NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
              for (int i = 0; i < 4; ++i) part[n][i] = 0.0f;
            const uint32_t words[4] = {cw[u][r].x, cw[u][r].y, cw[u][r].z, cw[u][r].w};
#pragma unroll
            for (int s = 0; s < 4; ++s) {
              uint32_t a[4];
#pragma unroll
              for (int i = 0; i < 4; ++i) a[i] = ((words[s] >> (4 * i)) & 0x000F000Fu) | MAGIC;
#pragma unroll
              for (int n = 0; n < NT; ++n) mma16816<BF16>(part[n], a, xr[n][2 * s], xr[n][2 * s + 1]);
            }
            const float s0 = half_lo(cs[u][r].x), s8 = half_hi(cs[u][r].x);
            const float m0 = s0 * (half_lo(cs[u][r].y) + OFF), m8 = s8 * (half_hi(cs[u][r].y) + OFF);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              acc[r][n][0] += s0 * part[n][0] - m0 * xs[n][0];
              acc[r][n][1] += s0 * part[n][1] - m0 * xs[n][1];
              acc[r][n][2] += s8 * part[n][2] - m8 * xs[n][0];
              acc[r][n][3] += s8 * part[n][3] - m8 * xs[n][1];
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < W4_AHEAD; ++u)
#pragma unroll
        for (int r = 0; r < W4_RT; ++r) {
          cw[u][r] = nw[u][r];
          cs[u][r] = ns[u][r];
        }
    }

#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int ta = t0 + n * 8 + 2 * c;  // this lane's two rows of the n-tile: ta, ta + 1
      if (GATE_UP) {
        const int F = tiles * 8;  // gate and up tiles alternate: F = tiles / 2 * 16
        uint16_t* h = reinterpret_cast<uint16_t*>(out);
#pragma unroll
        for (int p = 0; p < W4_RT / 2; ++p) {
          const int f = (tile0 / 2 + p) * 16 + g;
          const float* gt = acc[2 * p][n];
          const float* up = acc[2 * p + 1][n];
          const uint32_t lo = to16x2<BF16>(silu(gt[0]) * up[0], silu(gt[2]) * up[2]);  // row ta: f, f + 8
          const uint32_t hi = to16x2<BF16>(silu(gt[1]) * up[1], silu(gt[3]) * up[3]);  // row ta + 1
          if (ta < cnt) {
            h[(size_t)(start + ta) * F + f] = (uint16_t)(lo & 0xffffu);
            h[(size_t)(start + ta) * F + f + 8] = (uint16_t)(lo >> 16);
          }
          if (ta + 1 < cnt) {
            h[(size_t)(start + ta + 1) * F + f] = (uint16_t)(hi & 0xffffu);
            h[(size_t)(start + ta + 1) * F + f + 8] = (uint16_t)(hi >> 16);
          }
        }
      } else {
        const int N = tiles * 16;
        float* y = reinterpret_cast<float*>(out);
        const bool atomic = gridDim.z > 1;
#pragma unroll
        for (int r = 0; r < W4_RT; ++r) {
          const int o = (tile0 + r) * 16 + g;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = ta + (i & 1);
            const int col = o + (i >> 1) * 8;
            if (row < cnt) {
              float* dst = y + (size_t)(start + row) * N + col;
              if (atomic) atomicAdd(dst, acc[r][n][i]);
              else *dst = acc[r][n][i];
            }
          }
        }
      }
    }
  }
}

#define W4_ENTRY(NAME, NT, GATE_UP, BF16)                                                                        \
  extern "C" __global__ void __launch_bounds__(W4_WARPS * 32) NAME(                                                 \
      const uint16_t* x, const uint4* w, const uint2* sz, void* out, const int* offsets, int tiles, int chunks,  \
      int chunks_per_group, int groups, int K, int chunks_per_split) {                                           \
    w4_moe<NT, GATE_UP, BF16>(x, w, sz, out, offsets, tiles, chunks, chunks_per_group, groups, K,                \
                              chunks_per_split);                                                                 \
  }

W4_ENTRY(w4_gate_up_bf16_1, 1, true, true)
W4_ENTRY(w4_gate_up_bf16_2, 2, true, true)
W4_ENTRY(w4_gate_up_bf16_4, 4, true, true)
W4_ENTRY(w4_down_bf16_1, 1, false, true)
W4_ENTRY(w4_down_bf16_2, 2, false, true)
W4_ENTRY(w4_down_bf16_4, 4, false, true)
W4_ENTRY(w4_gate_up_fp16_1, 1, true, false)
W4_ENTRY(w4_gate_up_fp16_2, 2, true, false)
W4_ENTRY(w4_gate_up_fp16_4, 4, true, false)
W4_ENTRY(w4_down_fp16_1, 1, false, false)
W4_ENTRY(w4_down_fp16_2, 2, false, false)
W4_ENTRY(w4_down_fp16_4, 4, false, false)
