"""The version of mixprec, in a leaf of its own so any module can read it without importing the package."""

__version__ = "0.1.0"
