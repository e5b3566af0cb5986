"""Sampling (orca_jax/sample): logits rules and each batch's sampling inputs on the host, the device ops."""
