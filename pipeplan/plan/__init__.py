"""Planning: profile in, plan out. Pure Python; no torch.

graph.py (layer graph), partition.py and ilp.py (exact splits), memory.py (the memory model),
schedules.py and simulate.py (the schedule simulator), planner.py (the search), baselines.py.
"""
