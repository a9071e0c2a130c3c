"""runner: an offline batch job runner for LLM extraction over document collections."""

__version__ = "0.1.0"
