"""Host-side state and decisions, in plain Python (never jax): requests, the KV page allocator and
prefix index (kv/), the scheduler, its plan and its policies (sched/)."""
