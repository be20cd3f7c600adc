"""berth planner: specs, search and plans. Import submodules directly; nothing runs at import."""

__version__ = "0.1.0"
