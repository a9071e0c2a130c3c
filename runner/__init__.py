"""runner: an offline batch job runner for LLM extraction over document collections."""

__version__ = "0.2.0"  # the one version source (pyproject reads it); see CHANGELOG.md
