"""The SDK version: the same string as include/warren/version.h (WARREN_VERSION)."""
__version__ = "0.1.0"
