"""An OpenAI-compatible HTTP server over the speculative engine."""
