"""The sampling programs' device code: token selection (sampling.py) and logits processing (penalties.py)."""
