"""OpenAI-compatible HTTP front-end (FastAPI)."""
