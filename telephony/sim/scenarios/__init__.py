"""Built-in scenarios for the Realtime simulator (JSON files, loaded via importlib.resources)."""
