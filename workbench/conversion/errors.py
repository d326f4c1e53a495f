"""The conversion tools' input error (its own module so that every conversion module can raise it)."""

from __future__ import annotations

__all__ = ["ConversionError"]


class ConversionError(ValueError):
    """Bad conversion input: the message names the file / field and the fix."""
