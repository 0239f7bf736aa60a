"""MXFP4 (OCP Microscaling, GPT-OSS's experts) as numbers: what a 4-bit E2M1 code and a uint8 E8M0 exponent mean.
Shared by the readers (quant/mxfp4.py) and the kernels that decode the codes themselves (kernels/cpu)."""

BLOCK = 32  # values per E8M0 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # code -> value
SCALE_BIAS = 127  # a block's scale is 2^(exponent - SCALE_BIAS)
