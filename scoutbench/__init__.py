"""scoutbench: benchmark and evaluate KV-cache offloading attention for long-context LLM decode."""

__version__ = "0.1.0"
