"""Pure tensor ops. Every op here has a separately written float64 reference in ``tests/references.py``."""
