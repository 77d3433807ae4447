"""Model checkpoints the server builds or loads locally."""
