"""Multi-LoRA serving (orca_jax/lora)."""
