"""Host-side state and decisions (orca_jax/core): the KV allocator, prefix caching, the scheduler, policies, preemption."""
