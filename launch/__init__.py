"""Launch files: each engine's own files written from a plan (writers.py), by the engine table's format."""
