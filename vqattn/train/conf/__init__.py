"""The trainer's Hydra configs (a package, so that Hydra finds them in an installed vqattn)."""
