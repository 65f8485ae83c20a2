"""vqattn: codebook attention for PyTorch."""

__version__ = "0.1.0"
