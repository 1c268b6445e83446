"""The OpenAI-compatible HTTP server: FastAPI app over an ``AsyncEngine``."""
