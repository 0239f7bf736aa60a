"""Emit the C of the int8-activation kernels: the inputs quantized to int8 per block of ACT_BLOCK values, the weight
codes multiplied with them on AVX512-VNNI's `vpdpbusd` (four u8 x s8 products summed into each int32 lane), for
several rows per weight load. codegen.generate splices these into its drivers in place of the float tiles (isa
"avx512_vnni").

Activations: each row's block b gets d_b = max|x| / 127 and q = round(x / d_b) in -127..127 (symmetric); the row
record (`REC` floats a row) holds, per group, sum_b d_b * sum(q_b) (the zero-point term, taken from the quantized
inputs so the whole product sees one consistent x), then every d_b, every sum(q_b) (int32) and the 32 bytes of each
32-value unit's q in the order the weights' bytes come out of their words (below). Blocks of 16 rather than 32: the
relative error of a gated expert (two projections, SwiGLU between; Gaussian inputs) falls from about 1.2% to 1.0%
(one product's: about 0.45%) for one more convert and FMA per 16 values (about 6% of the time at 64 rows).

Weights stay in gemv.py's layout (one output row per lane, a unit = `bits` words per lane). A word's codes sit at
bit offsets j * bits; masking the word shifted right by s with the byte mask 2^bits - 1 repeated in every byte
leaves code (8b + s) / bits of the word in byte b: 8 / bits shifts of each of the unit's `bits` words give the
unit's 32 codes as 8 vectors of 4 unsigned bytes a lane, each one `vpdpbusd` against 4 activation bytes broadcast
(the prepared order); the first 4 of them hold values 0..15, the last 4 values 16..31 (words hold consecutive
values), so a block's dots are whole vectors. 2, 4 and 8 bits have whole codes in each byte; 3-bit codes straddle
bytes (not read here).

Affine codes: y = sum_g s_g (sum_b d_b <q_b, c_b> - z_g sum_b d_b sum(q_b)), the same factorisation as the float
tiles. MXFP4: a byte permute maps each E2M1 code c to the unsigned byte 2 v(c) + 12 (0..24), so
<q, 2 v + 12> - 12 sum(q) = 2 <q, v> and y = sum_g 2^(e_g - 128) sum_b d_b (<q_b, 2 v + 12> - 12 sum(q_b)).
Dots of a block fit int32 with room to spare (at most 32 * 255 * 127).
"""

from __future__ import annotations

from moeserve.kernels.cpu.codegen_epilogue import group_epilogue
from moeserve.kernels.mxfp4_format import E2M1_VALUES

INT8_BITS = (2, 4, 8)  # widths whose codes lie whole in bytes
MXFP4_OFFSET = 12  # added to 2 v(c) so every MXFP4 byte is unsigned
ACT_BLOCK = 16  # input values per int8 scale (16 or 32)
BLOCKS = 32 // ACT_BLOCK  # blocks per 32-value unit
REC_FLOATS_PER_UNIT = 2 * BLOCKS + 8  # a unit's scales d, sums of q and 8 words of q in a row record

PRELUDE = """#define DPBUSD(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#define ZEROI() _mm512_setzero_si512()
#define SUBI(a, b) _mm512_sub_epi32((a), (b))
#define SHUFFLE_BYTES(table, v) _mm512_shuffle_epi8((table), (v))
"""


def byte_order(bits: int) -> list[int]:
    """Value (0..31) of a unit in prepared byte i: byte b of the (word k, shift s) vector, the 8 / bits shifts of
    word k in turn, holds code (8b + s) / bits of word k (32 / bits codes a word)."""
    per_word, shifts = 32 // bits, range(0, 8, bits)
    return [k * per_word + (8 * b + s) // bits for k in range(bits) for s in shifts for b in range(4)]


def rec_macro() -> str:
    """REC(ng, group): floats of a row record (per group sums, then per block d and sum(q), per unit q)."""
    return f"#define REC(ng, group) ((ng) + (ng) * ((group) / 32) * {REC_FLOATS_PER_UNIT})"


def prepare_rows(bits: int) -> str:
    """C of `prepare_rows(x, m, ldx, n_groups, group, rec)`: each row's record (module docstring)."""
    order = ", ".join(str(v) for v in byte_order(bits))
    V = range(ACT_BLOCK // 16)  # float vectors a block
    loads = "\n".join(f"          const VF v{i} = LOADF(xb + {16 * i});" for i in V)
    absmax = "_mm512_abs_ps(v0)" if len(V) == 1 else "_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))"
    # to the nearest integer, ties to even (the default rounding mode), saturated to int8 (|x * inv| <= 127)
    rounds = "\n".join(f"          const VI i{i} = _mm512_cvtps_epi32(MUL(v{i}, inv));\n"
                       f"          _mm_storeu_si128((__m128i*)(qv + h * {ACT_BLOCK} + {16 * i}), "
                       f"_mm512_cvtsepi32_epi8(i{i}));" for i in V)
    sums = "i0" if len(V) == 1 else "_mm512_add_epi32(i0, i1)"
    return f"""/* rec [m, REC(n_groups, group)]: each row's inputs quantized per {ACT_BLOCK} values to int8
   (symmetric), with their scales, sums and per-group zero-point terms (codegen_int8.py) */
static const unsigned char UNIT_BYTE_ORDER[32] = {{{order}}};

static void prepare_rows(const float* x, int m, int ldx, int n_groups, int group, float* rec) {{
  const int units = group / 32, nu = n_groups * units;
  for (int r = 0; r < m; r++) {{
    float* sums = rec + (size_t)r * REC(n_groups, group);
    float* d = sums + n_groups;
    int32_t* qs = (int32_t*)(d + {BLOCKS} * nu);
    int8_t* q = (int8_t*)(d + {2 * BLOCKS} * nu);
    const float* xr = x + (size_t)r * ldx;
    for (int g = 0; g < n_groups; g++) {{
      float gsum = 0.0f;
      for (int u = 0; u < units; u++) {{
        const int ku = g * units + u;
        int8_t qv[32];
        for (int h = 0; h < {BLOCKS}; h++) {{
          const int kb = ku * {BLOCKS} + h;
          const float* xb = xr + (size_t)kb * {ACT_BLOCK};
{loads}
          const float amax = _mm512_reduce_max_ps({absmax});
          const VF inv = SET1F(amax > 0.0f ? 127.0f / amax : 0.0f);
{rounds}
          d[kb] = amax / 127.0f;
          qs[kb] = _mm512_reduce_add_epi32({sums});
          gsum += d[kb] * (float)qs[kb];
        }}
        for (int i = 0; i < 32; i++) q[(size_t)ku * 32 + i] = qv[UNIT_BYTE_ORDER[i]];
      }}
      sums[g] = gsum;
    }}
  }}
}}"""


def _byte_table() -> str:
    """The MXFP4 code -> 2 v + 12 byte table, in every 128-bit lane (the byte permute indexes within lanes)."""
    entries = ", ".join(str(int(2 * v) + MXFP4_OFFSET) for v in E2M1_VALUES)
    return f"  const VI btab = _mm512_broadcast_i32x4(_mm_setr_epi8({entries}));"


def tile_function(bits: int, rows: int, vectors: int, lanes: int, mxfp4: bool) -> str:
    """C of `tile_r{rows}`: rows x vectors outputs over groups g0..g1, codegen's tile signature; x is not read (the
    row records in `xsum` hold the quantized inputs)."""
    if bits not in INT8_BITS or (mxfp4 and bits != 4):
        raise ValueError(f"no int8-activation CPU kernel for {bits}-bit {'MXFP4 ' if mxfp4 else ''}weights")
    R, T = range(rows), range(vectors)
    byte_mask = int.from_bytes(bytes([(1 << bits) - 1] * 4), "little")
    L = [f"static void tile_r{rows}(const float* x, int ldx, const float* xsum, int n_groups,",
         "                         const uint32_t* w, const scale_t* s, const scale_t* z, int W,",
         "                         float* y, int ldy, int ob, int g0, int g1, int group, int first) {",
         "  (void)x; (void)ldx; (void)z;",
         "  const int units = group / 32, nu = n_groups * units, stride = REC(n_groups, group);",
         f"  const VI bmask = SET1I({byte_mask:#x}); (void)bmask;"]
    if mxfp4:
        L.append(_byte_table())
    for r in R:
        L += [f"  const float* d{r} = xsum + {r} * stride + n_groups;",
              f"  const int32_t* qs{r} = (const int32_t*)(d{r} + {BLOCKS} * nu); (void)qs{r};",
              f"  const int32_t* xq{r} = (const int32_t*)(d{r} + {2 * BLOCKS} * nu);"]
    for r in R:
        for t in T:
            L.append(f"  VF acc{r}_{t} = first ? ZERO() : LOADF(y + {r} * ldy + (ob + {t}) * {lanes});")
    L.append("  for (int g = g0; g < g1; g++) {")
    L += [f"    VF ga{r}_{t} = ZERO();" for r in R for t in T]
    L += ["    for (int u = 0; u < units; u++) {",
          "      const int ku = g * units + u;",
          f"      const size_t word = (size_t)ku * {bits};"]
    for t in T:
        base = f"w + ((size_t)(ob + {t}) * W + word) * {lanes}"
        L += [f"      const VI q{t}_{j} = LOADI({base} + {j * lanes});" for j in range(bits)]
    pairs = [(k, shift) for k in range(bits) for shift in range(0, 8, bits)]  # the unit's 8 byte vectors, in order
    per_block = len(pairs) // BLOCKS
    for h in range(BLOCKS):
        L.append("      {")
        L += [f"        VI di{r}_{t} = ZEROI();" for r in R for t in T]
        for p in range(h * per_block, (h + 1) * per_block):
            k, shift = pairs[p]
            L.append("        {")
            for t in T:
                word = f"q{t}_{k}" if shift == 0 else f"SRLI(q{t}_{k}, {shift})"
                codes = word if bits == 8 else f"ANDI({word}, bmask)"
                L.append(f"          const VI b{t} = {f'SHUFFLE_BYTES(btab, {codes})' if mxfp4 else codes};")
            for r in R:
                L.append(f"          const VI xb{r} = SET1I(xq{r}[(size_t)ku * 8 + {p}]);")
                L += [f"          di{r}_{t} = DPBUSD(di{r}_{t}, b{t}, xb{r});" for t in T]
            L.append("        }")
        for r in R:
            block = f"ku * {BLOCKS} + {h}" if BLOCKS > 1 else "ku"
            L.append(f"        const VF dv{r} = SET1F(d{r}[{block}]);")
            if mxfp4:
                L.append(f"        const VI zq{r} = SET1I({MXFP4_OFFSET} * qs{r}[{block}]);")
            dots = [f"SUBI(di{r}_{t}, zq{r})" if mxfp4 else f"di{r}_{t}" for t in T]
            L += [f"        ga{r}_{t} = FMA(dv{r}, CVT({dots[t]}), ga{r}_{t});" for t in T]
        L.append("      }")
    L.append("    }")
    # MXFP4: 2^(e - 127) from the exponent byte, halved: the dots are of 2 v
    L += group_epilogue(R, T, lanes, mxfp4, "stride", "SET1F(0.5f)")
    L.append("  }")
    L += [f"  STOREF(y + {r} * ldy + (ob + {t}) * {lanes}, acc{r}_{t});" for r in R for t in T]
    L.append("}")
    return "\n".join(L)
