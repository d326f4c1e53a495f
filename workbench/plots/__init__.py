"""plots package (import-free marker)."""
