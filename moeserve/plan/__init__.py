"""Throughput planning (MoE-Lightning): hardware profile, hierarchical roofline model, policy search,
and the CPU-GPU-I/O pipeline that executes a policy."""
