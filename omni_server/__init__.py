"""omni-server: a multi-stage omni inference server (OpenAI-compatible API over a YAML pipeline of stages)."""

__version__ = "0.1.0"
