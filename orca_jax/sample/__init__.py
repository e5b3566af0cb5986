"""Sampling: which program a batch needs (mode.py), what a request asks of its logits (rules.py), each
batch's sampling inputs on the host (batcher.py), the device ops (ops/) and the programs' state (sampler.py)."""
