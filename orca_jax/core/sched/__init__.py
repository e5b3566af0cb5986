"""ORCA's iteration-level scheduling: the plan of one iteration (output.py), how a request's share of it
is made (planner.py), the scheduler the engine drives (scheduler.py, behind interface.py) and its
ordering policies (policies.py)."""
