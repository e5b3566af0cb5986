"""Multi-LoRA serving: many peft adapters of one base model, mixed in one ragged batch.

request.py (LoRARequest), adapter.py (peft directories read and checked), slots.py (which adapter is
in which device slot; no jax), manager.py (the engine's adapters: registry, host cache, slots),
layout.py and table.py (the device table), ops.py (the adapter term of a projection).
"""

from orca_jax.lora.request import LoRARequest

__all__ = ["LoRARequest"]
