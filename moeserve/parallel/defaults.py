"""Defaults of the parallel options, in a module without torch so that `moeserve --help` can show them fast."""

STATIC_MAX_TOKENS = 128  # tokens per rank up to which dispatch uses static buffers
COLLECTIVE_TIMEOUT_S = 120.0  # seconds a rank waits in a collective for a peer (--collective-timeout)
