"""The group epilogue both generated CPU tiles share (codegen.py's float tiles, codegen_int8.py's int8 ones): a
group's sums into the accumulators, scaled by the group's scale (MXFP4: its E8M0 exponent) less zero * sum(x)."""

from __future__ import annotations


def group_epilogue(rows: range, vectors: range, lanes: int, mxfp4: bool, xsum_stride: str,
                   mxfp4_factor: str = "") -> list[str]:
    """C lines that add ga{r}_{t} (the group's sums) into acc{r}_{t}: s * ga - s * z * xsum (HQQ), or
    e * ga (MXFP4, e times mxfp4_factor, a C expression's product, when given). xsum_stride: the C name of a
    row's stride in xsum."""
    L = []
    for t in vectors:
        base = f"((size_t)(ob + {t}) * n_groups + g) * {lanes}"
        if mxfp4:
            scale = f"LOADE8(s + {base})"
            L.append(f"    {{ const VF sv = {f'MUL({mxfp4_factor}, {scale})' if mxfp4_factor else scale};")
            L += [f"      acc{r}_{t} = FMA(sv, ga{r}_{t}, acc{r}_{t});" for r in rows]
            L.append("    }")
            continue
        L += [f"    {{ const VF sv = LOADH(s + {base});",
              f"      const VF zv = MUL(sv, LOADH(z + {base}));"]
        for r in rows:
            L += [f"      acc{r}_{t} = FMA(sv, ga{r}_{t}, acc{r}_{t});",
                  f"      acc{r}_{t} = FNMA(zv, SET1F(xsum[{r} * {xsum_stride} + g]), acc{r}_{t});"]
        L.append("    }")
    return L
