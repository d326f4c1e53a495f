"""Per-sample seeds for the families' synthetic datasets: one 32-bit seed per (seed, offset, index)."""

from __future__ import annotations

__all__ = ["mix32"]


def mix32(*values: int) -> int:
    """splitmix64 over the values, folded to 32 bits (distinct streams for distinct inputs; torch's CPU
    generator keeps only 32 bits of a seed)."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0xFFFFFFFF
