"""Fine-tuning while serving (orca_jax/finetune)."""
