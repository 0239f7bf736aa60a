"""Hybrid expert backend: routed experts live in host RAM and are computed on the CPU where they lie; a GPU
cache holds some of them (static layers or a dynamic cache) and computes those on the GPU meanwhile."""
