"""Choices of the quantization options, in a module without torch so that `moeserve --help` and argument errors
answer at once."""

DENSE_BITS = (16, 8)  # --dense-bits: the dense part's linear layers at 16 (the compute dtype's float) or 8 bits (HQQ)
