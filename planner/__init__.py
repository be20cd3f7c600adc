"""berth planner: inputs, topology, search, placement, plans, probes and calibration, on top of the cost
model. Import submodules directly; nothing runs at import."""
