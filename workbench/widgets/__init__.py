"""widgets package (import-free marker)."""
