"""The model (engine.model) and what runs it (engine.runtime)."""
