"""LoRARequest: which adapter a request runs with (vLLM's class and field names; no jax)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter saved by peft (adapter_config.json + adapter_model.safetensors) under a name.

    lora_int_id identifies the adapter's weights across the engine (and salts the prefix cache): two
    adapters never share one, and one adapter keeps it.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must be a non-empty string")
