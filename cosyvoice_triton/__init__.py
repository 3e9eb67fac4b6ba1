"""CosyVoice2 served on Triton: the library that the Triton models, the gateway, the SDK and the tools import."""

__version__ = "0.1.0"  # the one place the version is written: pyproject.toml reads it (CHANGELOG.md per release)
