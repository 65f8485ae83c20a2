"""lm-evaluation-harness tasks on local data (``vqattn-eval`` includes this directory): see ``data.py``."""
