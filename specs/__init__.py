"""berth's vocabulary, the ground floor: the typed spec tree (tree.py), the parallel axes, errors, layout
parsing, model presets, stage splits, the candidate arrays, the rule table (validity.py), the engine table
(engines.py), the cost terms' names (terms.py) and the hardware schema (hardware.py). It imports nothing
else of berth; every other package builds on it (docs/design.md, "Floors"). Nothing runs at import."""

__version__ = "0.1.0"
