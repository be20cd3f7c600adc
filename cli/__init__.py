"""The command line (main.py, the `berth` entry point) with its tables (render.py) and figures (plots.py):
the top floor, a thin edge over the planner, the launch writers, the executor and the service."""
