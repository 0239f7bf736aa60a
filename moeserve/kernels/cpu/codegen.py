"""Emit the C source of a low-bit GEMV/GEMM kernel y = x W^T for one (ISA, bits, register tile).

Weights come in the pack.py codes (or as MXFP4: E2M1 codes, one E8M0 exponent per 32 values, no zero point),
repacked once so that each SIMD lane is one output row: the words of output rows o..o+V-1 are interleaved
([out / V, words per row, V] int32, see gemv.py). One unit of 32 input values is `bits` consecutive words per lane
for every width (3-bit: 10 + 10 + 10 values and the last two from the top bit pairs; gemv.py puts pack.py's
word-planar 3-bit rows unit after unit, word k of unit u at 3u + k), so the same loop serves 2/3/4/8 bits and MXFP4.

The arithmetic uses y = sum_g s_g (<x_g, q_g> - z_g <x_g, 1>): the inner loop is shift, mask,
int->float and one FMA per row of the register tile (where a register permute can index a table of the
2^bits code values - AVX-512 up to 4 bits, AVX2 up to 3 - shift + permute replace mask + convert);
scale and zero enter once per group. MXFP4: y = sum_g 2^(e_g - 127) <x_g, v(q_g)>, the E2M1 value table one
register permute on AVX-512 (16 entries), 8 magnitudes and the sign bit xor-ed in on AVX2, a lookup per lane
elsewhere; the exponent byte shifted into a float's exponent field is the group's scale.

Register tile: `rows` input rows x `vectors` output vectors (V lanes each) accumulate in registers; the
driver walks output tiles in parallel (on the native pool, pool.py), input blocks of `kb` values (sized for L1 by tuning.py)
and row chunks of `rows`. The batched driver makes every output tile of every product one parallel job.
"""

from __future__ import annotations

from moeserve.kernels.cpu import codegen_int8
from moeserve.kernels.cpu.codegen_epilogue import group_epilogue
from moeserve.kernels.cpu.machine import INT8_ISA, ISAS
from moeserve.kernels.mxfp4_format import E2M1_VALUES

_PRELUDE = {
    "avx512": """#include <immintrin.h>
typedef __m512 VF; typedef __m512i VI;
#define LOADI(p) _mm512_loadu_si512((const void*)(p))
#define LOADF(p) _mm512_loadu_ps(p)
#define STOREF(p, v) _mm512_storeu_ps((p), (v))
#define SET1F(a) _mm512_set1_ps(a)
#define SET1I(a) _mm512_set1_epi32(a)
#define ZERO() _mm512_setzero_ps()
#define SRLI(v, n) _mm512_srli_epi32((v), (n))
#define SLLI(v, n) _mm512_slli_epi32((v), (n))
#define ANDI(a, b) _mm512_and_si512((a), (b))
#define ORI(a, b) _mm512_or_si512((a), (b))
#define CVT(v) _mm512_cvtepi32_ps(v)
#define FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define FNMA(a, b, c) _mm512_fnmadd_ps((a), (b), (c))
#define MUL(a, b) _mm512_mul_ps((a), (b))
#define LUT(v, table) _mm512_permutexvar_ps((v), (table))
#define LOADH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
#define LOADE8(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p))), 23))
""",
    "avx2": """#include <immintrin.h>
typedef __m256 VF; typedef __m256i VI;
#define LOADI(p) _mm256_loadu_si256((const __m256i*)(p))
#define LOADF(p) _mm256_loadu_ps(p)
#define STOREF(p, v) _mm256_storeu_ps((p), (v))
#define SET1F(a) _mm256_set1_ps(a)
#define SET1I(a) _mm256_set1_epi32(a)
#define ZERO() _mm256_setzero_ps()
#define SRLI(v, n) _mm256_srli_epi32((v), (n))
#define SLLI(v, n) _mm256_slli_epi32((v), (n))
#define ANDI(a, b) _mm256_and_si256((a), (b))
#define ORI(a, b) _mm256_or_si256((a), (b))
#define CVT(v) _mm256_cvtepi32_ps(v)
#define FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define FNMA(a, b, c) _mm256_fnmadd_ps((a), (b), (c))
#define MUL(a, b) _mm256_mul_ps((a), (b))
#define LUT(v, table) _mm256_permutevar8x32_ps((table), (v))
#define LOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#define LOADE8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p))), 23))
#define SIGNED(m, v) _mm256_xor_ps((m), _mm256_castsi256_ps(_mm256_slli_epi32(ANDI((v), SET1I(8)), 28)))
""",
    "portable": """#include <string.h>
typedef float VF __attribute__((vector_size(32)));
typedef uint32_t VI __attribute__((vector_size(32)));
static inline VI LOADI(const uint32_t* p) { VI v; memcpy(&v, p, sizeof v); return v; }
static inline VF LOADF(const float* p) { VF v; memcpy(&v, p, sizeof v); return v; }
static inline void STOREF(float* p, VF v) { memcpy(p, &v, sizeof v); }
static inline VF SET1F(float a) { return (VF){a, a, a, a, a, a, a, a}; }
static inline VI SET1I(uint32_t a) { return (VI){a, a, a, a, a, a, a, a}; }
#define ZERO() SET1F(0.0f)
#define SRLI(v, n) ((v) >> (n))
#define SLLI(v, n) ((v) << (n))
#define ANDI(a, b) ((a) & (b))
#define ORI(a, b) ((a) | (b))
#define CVT(v) __builtin_convertvector((v), VF)
#define FMA(a, b, c) ((a) * (b) + (c))
#define FNMA(a, b, c) ((c) - (a) * (b))
#define MUL(a, b) ((a) * (b))
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) { const float v = (float)m * (1.0f / 16777216.0f); return sign ? -v : v; }  /* zero, subnormal */
  const uint32_t bits = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float f; memcpy(&f, &bits, sizeof f); return f;
}
static inline VF LOADH(const uint16_t* p) {
  VF v; for (int i = 0; i < 8; i++) v[i] = half_to_float(p[i]); return v;
}
static inline VF LOADE8(const uint8_t* p) {
  VI b; for (int i = 0; i < 8; i++) b[i] = (uint32_t)p[i] << 23;
  VF v; memcpy(&v, &b, sizeof v); return v;
}
static inline VF LUT16(VI v, const float* table) {
  VF r; for (int i = 0; i < 8; i++) r[i] = table[v[i] & 15]; return r;
}
""",
}


# the device link's ask word (device_link.py): seq << LINK_SEQ_SHIFT | layer << LINK_LAYER_SHIFT | rows
LINK_SEQ_SHIFT, LINK_LAYER_SHIFT = 20, 12
LINK_MAX_LAYERS, LINK_MAX_ROWS = 1 << (LINK_SEQ_SHIFT - LINK_LAYER_SHIFT), (1 << LINK_LAYER_SHIFT) - 1

LUT_LANES = {"avx512": 16, "avx2": 8}  # table entries a permute instruction indexes with the low bits


def uses_lut(isa: str, bits: int) -> bool:
    """Codes convert to float by a register permute (table[i] = i mod 2^bits) instead of mask + convert."""
    return (1 << bits) <= LUT_LANES.get(isa, 0)


def _code_source(bits: int, i: int, t: int) -> tuple[str, int]:
    """(vector, bit offset) holding code i (0..31) of the current unit for output vector t: word i // n at
    (i % n) * bits; 3 bits (pack.py's bits, words unit after unit): value 10k + j of the unit's word k at bit 3j
    (j < 5) or 16 + 3(j - 5), values 30 and 31 at bits 0 and 16 of the rebuilt rest{t}."""
    if bits != 3:
        word, j = divmod(i, 32 // bits)
        return f"q{t}_{word}", j * bits
    if i >= 30:
        return f"rest{t}", 16 * (i - 30)
    word, j = divmod(i, 10)
    return f"q{t}_{word}", 3 * j if j < 5 else 16 + 3 * (j - 5)


def _extract(bits: int, i: int, t: int, lut: bool) -> str:
    """Float expression for code i (0..31) of the current unit, lane-wise, for output vector t."""
    source, shift = _code_source(bits, i, t)
    shifted = source if shift == 0 else f"SRLI({source}, {shift})"
    if shift + bits == 32:
        return f"LUT({shifted}, lut)" if lut else f"CVT({shifted})"
    # the permute reads only the low bits, and its table repeats every 2^bits entries: no mask needed
    return f"LUT({shifted}, lut)" if lut else f"CVT(ANDI({shifted}, mask))"


def _mxfp4_extract(isa: str, i: int, t: int) -> str:
    """Float expression for E2M1 code i (0..31) of the current 32-value block, lane-wise, for output vector t: the
    16-entry value table by one permute (AVX-512), the 8 magnitudes by one permute and the sign bit xor-ed in (AVX2),
    a table read per lane (portable)."""
    source, shift = _code_source(4, i, t)
    shifted = source if shift == 0 else f"SRLI({source}, {shift})"
    return {"avx512": f"LUT({shifted}, lut)", "avx2": f"SIGNED(LUT({shifted}, lut), {shifted})"}.get(
        isa, f"LUT16({shifted}, lut)")


def _lut_declaration(isa: str, bits: int, mxfp4: bool) -> list[str]:
    """The code -> float table of a tile function: E2M1's values (MXFP4; AVX2 holds the 8 magnitudes), else the
    codes themselves (uses_lut); none where codes convert by mask + convert."""
    if mxfp4:
        values = E2M1_VALUES if isa != "avx2" else E2M1_VALUES[:8]
        entries = ", ".join(f"{v!r}f" for v in values)
        if isa == "portable":
            return [f"  static const float lut[16] = {{{entries}}};"]
        return [f"  const VF lut = _mm{'512' if isa == 'avx512' else '256'}_setr_ps({entries});"]
    if not uses_lut(isa, bits):
        return []
    entries = ", ".join(f"{float(i % (1 << bits))}f" for i in range(LUT_LANES[isa]))
    return [f"  const VF lut = _mm{'512' if isa == 'avx512' else '256'}_setr_ps({entries});"]


# the float tiles' row record: the zero-point term's group sums
_ROW_SUMS = '''/* xsum [m, n_groups]: the sum of each row's inputs per group (the zero-point term). */
static void prepare_rows(const float* x, int m, int ldx, int n_groups, int group, float* xsum) {
  for (int r = 0; r < m; r++)
    for (int g = 0; g < n_groups; g++) {
      float acc = 0.0f;
      for (int k = 0; k < group; k++) acc += x[(size_t)r * ldx + g * group + k];
      xsum[(size_t)r * n_groups + g] = acc;
    }
}'''


def _tile_function(isa: str, bits: int, rows: int, vectors: int, lanes: int, mxfp4: bool) -> str:
    R, T = range(rows), range(vectors)
    lut = uses_lut(isa, bits)
    L = [f"static void tile_r{rows}(const float* x, int ldx, const float* xsum, int n_groups,",
         "                         const uint32_t* w, const scale_t* s, const scale_t* z, int W,",
         "                         float* y, int ldy, int ob, int g0, int g1, int group, int first) {",
         f"  const VI mask = SET1I({(1 << bits) - 1}); (void)mask; (void)xsum; (void)z;"]
    L += _lut_declaration(isa, bits, mxfp4)
    for r in R:
        for t in T:
            L.append(f"  VF acc{r}_{t} = first ? ZERO() : LOADF(y + {r} * ldy + (ob + {t}) * {lanes});")
    L += ["  const int units = group / 32;",
          "  for (int g = g0; g < g1; g++) {"]
    L += [f"    VF ga{r}_{t} = ZERO();" for r in R for t in T]
    L += ["    for (int u = 0; u < units; u++) {",
          "      const int k = g * group + u * 32;",
          f"      const size_t word = (size_t)(k / 32) * {bits};"]  # the unit's words, side by side (gemv.py)
    for t in T:
        base = f"w + ((size_t)(ob + {t}) * W + word) * {lanes}"
        L += [f"      const VI q{t}_{j} = LOADI({base} + {j * lanes});" for j in range(bits)]
        if bits == 3:
            # bits 15 and 31 of word k are bit k of values 30 and 31: gathered to bits 0..2 and 16..18
            L.append(f"      const VI rest{t} = ORI(ORI(ANDI(SRLI(q{t}_0, 15), SET1I(0x10001)), "
                     f"ANDI(SRLI(q{t}_1, 14), SET1I(0x20002))), ANDI(SRLI(q{t}_2, 13), SET1I(0x40004)));")
    for r in R:
        L.append(f"      const float* x{r} = x + {r} * ldx + k;")
    for i in range(32):
        L.append("      {")
        L += [f"        const VF w{t} = {_mxfp4_extract(isa, i, t) if mxfp4 else _extract(bits, i, t, lut)};"
              for t in T]
        for r in R:
            L.append(f"        const VF xb{r} = SET1F(x{r}[{i}]);")
            L += [f"        ga{r}_{t} = FMA(xb{r}, w{t}, ga{r}_{t});" for t in T]
        L.append("      }")
    L.append("    }")
    L += group_epilogue(R, T, lanes, mxfp4, "n_groups")  # MXFP4: one E8M0 exponent per block, no zero point
    L.append("  }")
    L += [f"  STOREF(y + {r} * ldy + (ob + {t}) * {lanes}, acc{r}_{t});" for r in R for t in T]
    L.append("}")
    return "\n".join(L)


def generate(isa: str, bits: int, rows: int, vectors: int, mxfp4: bool = False) -> str:
    """C source exporting `qgemm` (one product), `qgemm_batch` (several of one shape, e.g. a layer's experts, in
    one parallel region) and `moe_layer` (a layer's routed experts on a few tokens, grouped, both projections, the
    SwiGLU and the weighted sum in one parallel region) for this ISA, bit width and register tile (rows x vectors).
    mxfp4: the weights are MXFP4 (4-bit E2M1 codes, one uint8 E8M0 exponent per 32-value group, no zero point)
    instead of affine codes with fp16 scales and zeros."""
    lanes = ISAS[isa][0]
    if bits not in (2, 3, 4, 8) or (mxfp4 and bits != 4):
        raise ValueError(f"no CPU kernel for {bits}-bit {'MXFP4 ' if mxfp4 else ''}weights")
    int8 = isa == INT8_ISA
    if int8:
        tiles = "\n\n".join([codegen_int8.prepare_rows(bits)] + [
            codegen_int8.tile_function(bits, r, vectors, lanes, mxfp4) for r in range(1, rows + 1)])
    else:
        tiles = "\n\n".join([_ROW_SUMS] + [_tile_function(isa, bits, r, vectors, lanes, mxfp4)
                                            for r in range(1, rows + 1)])
    prelude = _PRELUDE["avx512"] + codegen_int8.PRELUDE if int8 else _PRELUDE[isa]
    rec = codegen_int8.rec_macro() if int8 else "#define REC(ng, group) (ng)"
    cases = "\n".join(f"        case {r}: tile_r{r}(x + (size_t)r0 * ldx, ldx, xsum + (size_t)r0 * REC(n_groups, "
                      f"group), n_groups, w, s, z, W, y + (size_t)r0 * ldy, ldy, ob, g0, g1, group, g0 == 0); break;"
                      for r in range(1, rows + 1))
    return f"""// generated by moeserve.kernels.cpu.codegen: isa={isa} bits={bits}{' mxfp4' if mxfp4 else ''} \
tile={rows}x{vectors} lanes={lanes}
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <time.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
{prelude}
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() do {{ }} while (0)
#endif
#define LANES {lanes}
#define TILE_ROWS {rows}
#define TILE_VECTORS {vectors}
#define LINK_SEQ_SHIFT {LINK_SEQ_SHIFT}
#define LINK_LAYER_SHIFT {LINK_LAYER_SHIFT}
#define LINK_MAX_LAYERS {LINK_MAX_LAYERS}
#define LINK_MAX_ROWS {LINK_MAX_ROWS}
typedef {'uint8_t' if mxfp4 else 'uint16_t'} scale_t;  /* a group's scale (and zero): {'E8M0' if mxfp4 else 'fp16'} */
/* floats of a row's record of prepared inputs (prepare_rows): the group sums of the zero-point term, and with int8
   activations the quantized inputs */
{rec}

{tiles}

/* One output tile (TILE_VECTORS vectors from ob) of y [m, ldy] = x [m, ldx] W^T, over input blocks of gb groups. */
static void output_tile(const float* x, int m, int ldx, const float* xsum, int n_groups, const uint32_t* w,
                        const scale_t* s, const scale_t* z, int W, int group, float* y, int ldy, int ob, int gb) {{
  for (int g0 = 0; g0 < n_groups; g0 += gb) {{
    const int g1 = g0 + gb < n_groups ? g0 + gb : n_groups;
    for (int r0 = 0; r0 < m; r0 += TILE_ROWS) {{
      switch (m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS) {{
{cases}
      }}
    }}
  }}
}}

/* ---- threads: the process's native pool (moeserve/kernels/cpu/pool.py), handed over by moeserve_set_pool ---- */
typedef void (*mp_job)(void* ctx, int tid, int nth);
static void (*pool_run)(mp_job, void*, int);
static void (*pool_start)(mp_job, void*, int);
static void (*pool_wait)(void);

void moeserve_set_pool(void* run, void* start, void* wait) {{
  pool_run = (void (*)(mp_job, void*, int))run;
  pool_start = (void (*)(mp_job, void*, int))start;
  pool_wait = (void (*)(void))wait;
}}

static void parallel(mp_job fn, void* ctx, int threads) {{
  if (pool_run && threads > 1) pool_run(fn, ctx, threads); else fn(ctx, 0, 1);
}}

/* [lo, hi): thread tid's share of n items, in order */
static void share(long n, int tid, int nth, long* lo, long* hi) {{
  *lo = n * tid / nth;
  *hi = n * (tid + 1) / nth;
}}

/* guided: the next run of consecutive items, a share of what is left (at least one): early runs are long, so a
   thread streams its weights as one run of memory the prefetchers follow; late runs are short, so threads end
   together */
static int next_run(atomic_long* counter, long n, int nth, long* lo, long* hi) {{
  long cur = atomic_load(counter);
  for (;;) {{
    if (cur >= n) return 0;
    long c = (n - cur) / (2L * nth);
    if (c < 1) c = 1;
    if (atomic_compare_exchange_weak(counter, &cur, cur + c)) {{
      *lo = cur;
      *hi = cur + c < n ? cur + c : n;
      return 1;
    }}
  }}
}}

/* every thread of the job waits here for the others (they are all running: a spin) */
typedef struct {{ atomic_int count; atomic_int gen; }} barrier_t;

static void barrier(barrier_t* b, int nth) {{
  if (nth <= 1) return;
  const int g = atomic_load(&b->gen);
  if (atomic_fetch_add(&b->count, 1) == nth - 1) {{
    atomic_store(&b->count, 0);
    atomic_fetch_add(&b->gen, 1);
  }} else {{
    unsigned spins = 0;
    while (atomic_load(&b->gen) == g)
      if (++spins % 4096) PAUSE(); else sched_yield();
  }}
}}

/* ---- y [m, ldy] = x [m, ldx] W^T ---- */
typedef struct {{
  const float* x; int m, ldx; const float* xsum; int n_groups; const uint32_t* w; const scale_t* s; const scale_t* z;
  int W, group; float* y; int ldy, n_tiles, gb;
}} gemm_job;

static void gemm_part(void* p, int tid, int nth) {{
  const gemm_job* j = (const gemm_job*)p;
  long lo, hi;
  share(j->n_tiles, tid, nth, &lo, &hi);
  for (long tile = lo; tile < hi; tile++)
    output_tile(j->x, j->m, j->ldx, j->xsum, j->n_groups, j->w, j->s, j->z, j->W, j->group, j->y, j->ldy,
                (int)tile * TILE_VECTORS, j->gb);
}}

/* w: [n_vectors][W][LANES] words, s/z: [n_vectors][n_groups][LANES] fp16 scale and zero; n_vectors a multiple of
   TILE_VECTORS; in_features and group multiples of 32. */
int qgemm(const float* x, int m, int ldx, int in_features, const uint32_t* w, const scale_t* s, const scale_t* z,
          int group, float* y, int ldy, int n_vectors, int kb, int threads) {{
  if (group % 32 || in_features % group || n_vectors % TILE_VECTORS || m < 1) return 1;
  const int n_groups = in_features / group;
  float* xsum = (float*)malloc(sizeof(float) * (size_t)m * REC(n_groups, group));
  if (!xsum) return 2;
  prepare_rows(x, m, ldx, n_groups, group, xsum);
  gemm_job j = {{x, m, ldx, xsum, n_groups, w, s, z, in_features / 32 * {bits}, group, y, ldy,
                n_vectors / TILE_VECTORS, kb / group < 1 ? 1 : kb / group}};
  parallel(gemm_part, &j, threads);
  free(xsum);
  return 0;
}}

/* ---- n products of one shape at once: y_b [ms[b], ldy] = x_b [ms[b], ldx] W_b^T for b < n ---- */
typedef struct {{
  const float* const* xs; const int* ms; int ldx; const size_t* first; const float* xsum; int n_groups;
  const uint32_t* const* ws; const scale_t* const* ss; const scale_t* const* zs; int W, group; float* const* ys;
  int ldy, n_tiles, gb; long jobs; atomic_long next;
}} batch_job;

static void batch_part(void* p, int tid, int nth) {{
  batch_job* j = (batch_job*)p;
  long lo, hi;
  (void)tid;
  while (next_run(&j->next, j->jobs, nth, &lo, &hi))  /* blocks differ in rows: guided */
    for (long job = lo; job < hi; job++) {{
      const int b = (int)(job / j->n_tiles), tile = (int)(job % j->n_tiles);
      output_tile(j->xs[b], j->ms[b], j->ldx, j->xsum + j->first[b] * REC(j->n_groups, j->group), j->n_groups,
                  j->ws[b], j->ss[b], j->zs[b], j->W, j->group, j->ys[b], j->ldy, tile * TILE_VECTORS, j->gb);
    }}
}}

/* a layer's experts: every output tile of every expert is one job, so small experts still fill the threads */
int qgemm_batch(int n, const float* const* xs, const int* ms, int ldx, int in_features, const uint32_t* const* ws,
                const scale_t* const* ss, const scale_t* const* zs, int group, float* const* ys, int ldy,
                int n_vectors, int kb, int threads) {{
  if (group % 32 || in_features % group || n_vectors % TILE_VECTORS || n < 1) return 1;
  const int n_groups = in_features / group;
  size_t* first = (size_t*)malloc(sizeof(size_t) * ((size_t)n + 1));
  if (!first) return 2;
  first[0] = 0;
  for (int b = 0; b < n; b++) {{
    if (ms[b] < 1) {{ free(first); return 1; }}
    first[b + 1] = first[b] + (size_t)ms[b];
  }}
  float* xsum = (float*)malloc(sizeof(float) * first[n] * REC(n_groups, group));
  if (!xsum) {{ free(first); return 2; }}
  for (int b = 0; b < n; b++)
    prepare_rows(xs[b], ms[b], ldx, n_groups, group, xsum + first[b] * REC(n_groups, group));
  const int n_tiles = n_vectors / TILE_VECTORS;
  const long jobs = (long)n * n_tiles;
  batch_job j = {{xs, ms, ldx, first, xsum, n_groups, ws, ss, zs, in_features / 32 * {bits}, group, ys, ldy, n_tiles,
                 kb / group < 1 ? 1 : kb / group, jobs, 0}};
  parallel(batch_part, &j, threads);
  free(xsum);
  free(first);
  return 0;
}}

/* ---- One MoE layer's experts on a few tokens as one job: out [T, D] = the sum over kept pairs p = (t, j) of
   wts[p] * (down_e(act(gate_e(x_t) + gb_e, up_e(x_t) + gb_e')) + db_e), e = ids[p], pairs grouped per expert
   (ascending) so each token's terms add in expert order. act: silu(g) * u, or (clamped) GPT-OSS's
   (min(u, limit) clamped at -limit, + 1) * g' * sigmoid(alpha g') with g' = min(g, limit) (model/experts.glu); the
   biases gb [2F] and db [D] per expert (GPT-OSS) or NULL arrays. gate_up outputs are the F gate rows then the F up
   rows, padded to gu_vectors * LANES; the E experts' repacked words/scales/zeros come as pointer arrays. Phases
   (gather, gate_up tiles, bias + activation, down tiles, weighted sum) are separated by the job's spin barriers: one
   wake-up of the threads per layer. ---- */
typedef struct {{
  int T, D, F, R, nb, group, ng_gu, ng_dn, ldh, ldy, Wgu, Wdn, gb_gu, gb_dn, tiles_gu, tiles_dn;
  const float* x; float* out;
  const uint32_t* const* gw; const scale_t* const* gs; const scale_t* const* gz;
  const uint32_t* const* dw; const scale_t* const* ds; const scale_t* const* dz;
  const float* const* gb; const float* const* db; int clamped; float alpha, limit;
  int *first, *used, *tok, *ex; float *wr, *xs, *xsum, *h, *a, *asum, *y;
  atomic_long next_gu, next_dn; barrier_t bar;
}} moe_job;

/* one projection (gate_up or down) of every used expert: output tiles taken from `next`, each over the expert's rows
   of `in` [R, ld_in] (their group sums in `sums`) into `out` [R, ld_out] */
static void projection(moe_job* j, atomic_long* next, int tiles, const float* in, int ld_in, const float* sums, int ng,
                       const uint32_t* const* w, const scale_t* const* s, const scale_t* const* z, int W, float* out,
                       int ld_out, int gb, int nth) {{
  long lo, hi;
  while (next_run(next, (long)j->nb * tiles, nth, &lo, &hi))
    for (long job = lo; job < hi; job++) {{
      const int e = j->used[job / tiles], tile = (int)(job % tiles), r0 = j->first[e];
      output_tile(in + (size_t)r0 * ld_in, j->first[e + 1] - r0, ld_in, sums + (size_t)r0 * REC(ng, j->group), ng,
                  w[e], s[e], z[e], W, j->group, out + (size_t)r0 * ld_out, ld_out, tile * TILE_VECTORS, gb);
    }}
}}

static void moe_part(void* p, int tid, int nth) {{
  moe_job* j = (moe_job*)p;
  long lo, hi;
  share(j->R, tid, nth, &lo, &hi);
  for (long r = lo; r < hi; r++) {{
    const float* src = j->x + (size_t)j->tok[r] * j->D;
    float* dst = j->xs + (size_t)r * j->D;
    for (int c = 0; c < j->D; c++) dst[c] = src[c];
    prepare_rows(dst, 1, j->D, j->ng_gu, j->group, j->xsum + (size_t)r * REC(j->ng_gu, j->group));
  }}
  barrier(&j->bar, nth);
  projection(j, &j->next_gu, j->tiles_gu, j->xs, j->D, j->xsum, j->ng_gu, j->gw, j->gs, j->gz, j->Wgu, j->h, j->ldh,
             j->gb_gu, nth);
  barrier(&j->bar, nth);
  share(j->R, tid, nth, &lo, &hi);
  for (long r = lo; r < hi; r++) {{
    float* hr = j->h + (size_t)r * j->ldh;
    float* ar = j->a + (size_t)r * j->F;
    if (j->gb) {{
      const float* b = j->gb[j->ex[r]];
      for (int c = 0; c < 2 * j->F; c++) hr[c] += b[c];
    }}
    if (j->clamped)
      for (int c = 0; c < j->F; c++) {{
        const float g = fminf(hr[c], j->limit), u = fminf(fmaxf(hr[j->F + c], -j->limit), j->limit);
        ar[c] = (u + 1.0f) * (g / (1.0f + expf(-j->alpha * g)));
      }}
    else
      for (int c = 0; c < j->F; c++) ar[c] = hr[c] / (1.0f + expf(-hr[c])) * hr[j->F + c];
    prepare_rows(ar, 1, j->F, j->ng_dn, j->group, j->asum + (size_t)r * REC(j->ng_dn, j->group));
  }}
  barrier(&j->bar, nth);
  projection(j, &j->next_dn, j->tiles_dn, j->a, j->F, j->asum, j->ng_dn, j->dw, j->ds, j->dz, j->Wdn, j->y, j->ldy,
             j->gb_dn, nth);
  barrier(&j->bar, nth);
  share((j->D + 63) / 64, tid, nth, &lo, &hi);
  for (long c0 = lo * 64; c0 < hi * 64 && c0 < j->D; c0 += 64) {{
    const long c1 = c0 + 64 < j->D ? c0 + 64 : j->D;
    for (int t = 0; t < j->T; t++)
      for (long c = c0; c < c1; c++) j->out[(size_t)t * j->D + c] = 0.0f;
    for (int r = 0; r < j->R; r++) {{
      float* o = j->out + (size_t)j->tok[r] * j->D;
      const float* yr = j->y + (size_t)r * j->ldy;
      if (j->db) {{
        const float* b = j->db[j->ex[r]];
        for (long c = c0; c < c1; c++) o[c] += j->wr[r] * (yr[c] + b[c]);
      }} else
        for (long c = c0; c < c1; c++) o[c] += j->wr[r] * yr[c];
    }}
  }}
}}

static void moe_free(moe_job* j) {{
  if (!j) return;
  free(j->first); free(j->used); free(j->tok); free(j->ex); free(j->wr); free(j->xs); free(j->xsum); free(j->h);
  free(j->a); free(j->asum); free(j->y); free(j);
}}

/* the job of one call, its buffers allocated and its pairs grouped; NULL with *rc set on bad arguments */
static moe_job* moe_prepare(int T, int k, const int64_t* ids, const float* wts, const uint8_t* mask, int E,
                            const float* x, int D, int F, const uint32_t* const* gw, const scale_t* const* gs,
                            const scale_t* const* gz, int gu_vectors, int kb_gu, const uint32_t* const* dw,
                            const scale_t* const* ds, const scale_t* const* dz, int dn_vectors, int kb_dn, int group,
                            const float* const* gb, const float* const* db, int clamped, float alpha, float limit,
                            float* out, int* rc) {{
  *rc = 1;
  if (group % 32 || D % group || F % group || T < 1 || k < 1 || E < 1 || gu_vectors % TILE_VECTORS
      || dn_vectors % TILE_VECTORS || gu_vectors * LANES < 2 * F || dn_vectors * LANES < D) return 0;
  *rc = 2;
  moe_job* j = (moe_job*)calloc(1, sizeof(moe_job));
  if (!j) return 0;
  const int n = T * k;
  int* fill = (int*)malloc(sizeof(int) * (size_t)E);
  j->first = (int*)calloc((size_t)E + 1, sizeof(int));
  j->used = (int*)malloc(sizeof(int) * (size_t)E);
  if (!fill || !j->first || !j->used) {{ free(fill); moe_free(j); return 0; }}
  int R = 0;
  for (int p = 0; p < n; p++) {{
    if ((mask && !mask[p]) || ids[p] < 0) continue;  /* a negative id: the pair is computed elsewhere (a GPU slot) */
    if (ids[p] >= E) {{ free(fill); moe_free(j); *rc = 3; return 0; }}
    j->first[ids[p] + 1]++;
    R++;
  }}
  int nb = 0;
  for (int e = 0; e < E; e++) {{
    if (j->first[e + 1]) j->used[nb++] = e;
    j->first[e + 1] += j->first[e];
    fill[e] = j->first[e];
  }}
  j->T = T; j->D = D; j->F = F; j->R = R; j->nb = nb; j->group = group;
  j->ng_gu = D / group; j->ng_dn = F / group; j->ldh = gu_vectors * LANES; j->ldy = dn_vectors * LANES;
  j->Wgu = D / 32 * {bits}; j->Wdn = F / 32 * {bits};
  j->gb_gu = kb_gu / group < 1 ? 1 : kb_gu / group; j->gb_dn = kb_dn / group < 1 ? 1 : kb_dn / group;
  j->tiles_gu = gu_vectors / TILE_VECTORS; j->tiles_dn = dn_vectors / TILE_VECTORS;
  j->x = x; j->out = out; j->gw = gw; j->gs = gs; j->gz = gz; j->dw = dw; j->ds = ds; j->dz = dz;
  j->gb = gb; j->db = db; j->clamped = clamped; j->alpha = alpha; j->limit = limit;
  j->tok = (int*)malloc(sizeof(int) * ((size_t)R + 1));
  j->ex = (int*)malloc(sizeof(int) * ((size_t)R + 1));
  j->wr = (float*)malloc(sizeof(float) * ((size_t)R + 1));
  j->xs = (float*)malloc(sizeof(float) * ((size_t)R * D + 1));
  j->xsum = (float*)malloc(sizeof(float) * ((size_t)R * REC(j->ng_gu, group) + 1));
  j->h = (float*)malloc(sizeof(float) * ((size_t)R * j->ldh + 1));
  j->a = (float*)malloc(sizeof(float) * ((size_t)R * F + 1));
  j->asum = (float*)malloc(sizeof(float) * ((size_t)R * REC(j->ng_dn, group) + 1));
  j->y = (float*)malloc(sizeof(float) * ((size_t)R * j->ldy + 1));
  if (!(j->tok && j->ex && j->wr && j->xs && j->xsum && j->h && j->a && j->asum && j->y)) {{
    free(fill); moe_free(j); return 0;
  }}
  for (int p = 0; p < n; p++) {{
    if ((mask && !mask[p]) || ids[p] < 0) continue;
    const int r = fill[ids[p]]++;
    j->tok[r] = p / k;
    j->ex[r] = (int)ids[p];
    j->wr[r] = wts[p];
  }}
  free(fill);
  *rc = 0;
  return j;
}}

#define MOE_ARGS int T, int k, const int64_t* ids, const float* wts, const uint8_t* mask, int E, const float* x, \
  int D, int F, const uint32_t* const* gw, const scale_t* const* gs, const scale_t* const* gz, int gu_vectors, \
  int kb_gu, const uint32_t* const* dw, const scale_t* const* ds, const scale_t* const* dz, int dn_vectors, \
  int kb_dn, int group, const float* const* gb, const float* const* db, int clamped, float alpha, float limit, \
  float* out, int threads
#define MOE_PASS T, k, ids, wts, mask, E, x, D, F, gw, gs, gz, gu_vectors, kb_gu, dw, ds, dz, dn_vectors, kb_dn, \
  group, gb, db, clamped, alpha, limit, out

/* the layer on the calling thread and threads - 1 helpers; returns when out is written (0, else an error code) */
int moe_layer(MOE_ARGS) {{
  int rc;
  moe_job* j = moe_prepare(MOE_PASS, &rc);
  if (!j) return rc;
  parallel(moe_part, j, threads);
  moe_free(j);
  return 0;
}}

/* the layer on `threads` helpers while the caller goes on: *handle for moe_layer_finish, which waits for it; the
   caller keeps x, ids, wts, mask and out alive until then. Returns 0, else an error code (no handle). */
int moe_layer_start(MOE_ARGS, void** handle) {{
  int rc;
  moe_job* j = moe_prepare(MOE_PASS, &rc);
  *handle = j;
  if (!j) return rc;
  if (pool_start && pool_wait) pool_start(moe_part, j, threads > 1 ? threads : 1);
  else moe_part(j, 0, 1);
  return 0;
}}

void moe_layer_finish(void* handle) {{
  if (pool_start && pool_wait) pool_wait();
  moe_free((moe_job*)handle);
}}

/* ---- The device link (kernels/cpu/device_link.py): a thread that runs MoE layers when a device asks for them
   through page-locked memory, so the device never waits on a host thread that is not already waiting for it.
   The device writes a layer's inputs (x [T, D] float32, ids [T, k] int64, wts [T, k] float32), then one word
   `ask` = seq << 20 | layer << 12 | T; the thread computes out [T, D] and writes `answer` = seq << 20, which the
   device waits for (a spinning kernel) before it reads out. One layer is in flight at a time (the next one needs
   this one's output), so one set of buffers serves every layer. ---- */
typedef struct {{
  int64_t k, E, D, F, gu_vectors, kb_gu, dn_vectors, kb_dn, group;
  const uint32_t* const* gw; const scale_t* const* gs; const scale_t* const* gz;
  const uint32_t* const* dw; const scale_t* const* ds; const scale_t* const* dz;
  const float* const* gb; const float* const* db; int64_t clamped; double alpha, limit;  /* biases, activation */
  int64_t calls, rows, errors, pairs;  /* what the thread did for this layer (read by the host): calls, token
                                          rows, calls answered with zeros, (token, expert) pairs computed */
}} link_layer;

typedef struct {{
  volatile int64_t* ask; volatile int64_t* answer;
  const int64_t* ids; const float* wts; const float* x; float* out;
  link_layer* layers; int64_t n_layers, max_rows, hidden, threads, cpu, spin_ns, seen;
  atomic_int stop; pthread_t thread;
}} link_t;

static long link_now_ns(void) {{
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000L + t.tv_nsec;
}}

/* one asked layer call: out [T, D] of the layer's table entry (zeros and an error count on a bad entry) */
static void link_answer(link_t* L, int64_t ask) {{
  const int layer = (int)((ask >> LINK_LAYER_SHIFT) & (LINK_MAX_LAYERS - 1)), T = (int)(ask & LINK_MAX_ROWS);
  link_layer* l = T && layer < L->n_layers ? &L->layers[layer] : 0;  /* T = 0: a ping, answered at once */
  int rc = 1;
  moe_job* j = l && l->gw && T <= L->max_rows
      ? moe_prepare(T, (int)l->k, L->ids, L->wts, 0, (int)l->E, L->x, (int)l->D, (int)l->F, l->gw, l->gs, l->gz,
                    (int)l->gu_vectors, (int)l->kb_gu, l->dw, l->ds, l->dz, (int)l->dn_vectors, (int)l->kb_dn,
                    (int)l->group, l->gb, l->db, (int)l->clamped, (float)l->alpha, (float)l->limit, L->out, &rc)
      : 0;
  if (j) {{
    parallel(moe_part, j, (int)L->threads);
    l->pairs += j->R;
    moe_free(j);
  }} else if (l) {{
    for (long i = 0; i < (long)(T < L->max_rows ? T : L->max_rows) * L->hidden; i++) L->out[i] = 0.0f;
    l->errors++;
  }}
  if (l) {{ l->calls++; l->rows += T; }}
  atomic_thread_fence(memory_order_release);
  *L->answer = ask >> LINK_SEQ_SHIFT << LINK_SEQ_SHIFT;
}}

static void* link_main(void* p) {{
  link_t* L = (link_t*)p;
#ifdef __linux__
  if (L->cpu >= 0) {{
    cpu_set_t set; CPU_ZERO(&set); CPU_SET((int)L->cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  }}
#endif
  int64_t seen = L->seen;
  long idle = link_now_ns();
  unsigned spins = 0;
  while (!atomic_load(&L->stop)) {{
    const int64_t ask = *L->ask;
    if ((ask >> LINK_SEQ_SHIFT) != seen) {{
      atomic_thread_fence(memory_order_acquire);
      seen = ask >> LINK_SEQ_SHIFT;
      link_answer(L, ask);
      idle = link_now_ns();
      continue;
    }}
    PAUSE();
    if (++spins % 256 == 0 && link_now_ns() - idle > L->spin_ns) {{
      struct timespec nap = {{0, 20000}};  /* idle: poll every ~20 us instead of spinning */
      nanosleep(&nap, 0);
    }}
  }}
  return 0;
}}

/* start the thread (pinned to cpu unless < 0) over the host buffers; a handle for link_stop, NULL on failure */
void* link_start(volatile int64_t* ask, volatile int64_t* answer, const int64_t* ids, const float* wts, const float* x,
                 float* out, link_layer* layers, int n_layers, int max_rows, int hidden, int threads, int cpu,
                 long spin_us) {{
  if (max_rows < 1 || max_rows > LINK_MAX_ROWS || n_layers < 1 || n_layers > LINK_MAX_LAYERS || hidden < 1)
    return 0;
  link_t* L = (link_t*)calloc(1, sizeof(link_t));
  if (!L) return 0;
  L->ask = ask; L->answer = answer; L->ids = ids; L->wts = wts; L->x = x; L->out = out; L->layers = layers;
  L->n_layers = n_layers; L->max_rows = max_rows; L->hidden = hidden; L->threads = threads; L->cpu = cpu;
  L->spin_ns = spin_us * 1000L;
  L->seen = *ask >> LINK_SEQ_SHIFT;  /* read here: an ask written before the thread runs is still new to it */
  if (pthread_create(&L->thread, 0, link_main, L)) {{ free(L); return 0; }}
  return L;
}}

void link_stop(void* handle) {{
  link_t* L = (link_t*)handle;
  if (!L) return;
  atomic_store(&L->stop, 1);
  pthread_join(L->thread, 0);
  free(L);
}}
"""
