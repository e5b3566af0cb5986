"""The test suite: one folder per package of orca_jax, shared builders in helpers/."""
