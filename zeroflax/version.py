"""The package version (pyproject.toml says the same), importable without importing the package face."""
__version__ = "0.1.0"
