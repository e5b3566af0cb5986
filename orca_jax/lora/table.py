"""A pipeline stage's LoRA adapter table on its devices, and the small program that fills one slot.

The table (lora/layout.py: per layer, max_loras slots x max_lora_rank) is an input of the stage's
forward programs that batches with adapted tokens run, so which adapters are loaded never changes a
program. Loading an adapter into a slot runs one precompiled update program that writes the slot in
place (the table is donated: it stays at one device address, as the staged inputs do) and compiles
nothing. Batches dispatched before the update read the old slot: the device runs programs in
dispatch order, and the scheduler only evicts a slot no running request uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from orca_jax.config import LoRAConfig, ModelConfig
from orca_jax.lora.adapter import LoRAAdapter
from orca_jax.lora.layout import SLOT_AXIS, layer_shapes, nest, slot_weights
from orca_jax.sharding import rules


def _specs(config: ModelConfig, num_slots: int, rank: int, num_layers: int, mesh: Mesh) -> tuple:
    """ShapeDtypeStructs (with shardings) of `num_layers` table layers of `num_slots` slots."""
    dtype = jnp.dtype(config.dtype)
    layer = nest({path: jax.ShapeDtypeStruct(shape, dtype)
                  for path, shape in layer_shapes(config, num_slots, rank).items()})
    shapes = tuple(layer for _ in range(num_layers))
    shardings = rules.param_shardings(shapes, mesh, rules.LORA_SPECS)
    return jax.tree_util.tree_map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                  shapes, shardings)


class StageLoRATable:
    """One stage's layers of the adapter table (zeros until a slot is loaded) and its update program."""

    def __init__(self, config: ModelConfig, lora: LoRAConfig, layers: range, mesh: Mesh, kv_repeat: int):
        self.config = config  # the device shapes
        self.num_slots, self.rank = lora.max_loras, lora.max_lora_rank
        self.layers = layers
        self._kv_repeat = kv_repeat
        self.specs = _specs(config, self.num_slots, self.rank, len(layers), mesh)
        self.slot_specs = _specs(config, 1, self.rank, len(layers), mesh)
        shardings = jax.tree_util.tree_map(lambda s: s.sharding, self.specs)
        self._slot_shardings = jax.tree_util.tree_map(lambda s: s.sharding, self.slot_specs)
        self._update_fn = jax.jit(_update_slot, donate_argnums=(0,), out_shardings=shardings)
        self._replicated_row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.table = jax.jit(lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.specs),
                             out_shardings=shardings)()

    @property
    def nbytes(self) -> int:
        """Device bytes of the table, all shards."""
        return sum(s.size * s.dtype.itemsize for s in jax.tree_util.tree_leaves(self.specs))

    def lower_update(self) -> jax.stages.Lowered:
        """The slot-update program: (table, donated; row i32[]; one slot's weights) -> table."""
        row = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated_row)
        return self._update_fn.lower(self.specs, row, self.slot_specs)

    def host_slot(self, adapter: LoRAAdapter) -> tuple:
        """This stage's layers of `adapter` as one slot (numpy, the table's dtype)."""
        dtype = np.dtype(jnp.dtype(self.config.dtype))
        return slot_weights(adapter, self.config, self._kv_repeat, self.rank, self.layers, dtype)

    def load(self, update: jax.stages.Compiled, row: int, adapter: LoRAAdapter | None) -> None:
        """Write `adapter` (None: zeros) into table row `row` (slot row + 1 in a batch's lora_slots)."""
        if not 0 <= row < self.num_slots:
            raise ValueError(f"slot row {row} is outside the table's {self.num_slots} slots")
        if adapter is None:
            host = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), self.slot_specs)
        else:
            host = self.host_slot(adapter)
        slot = jax.device_put(host, self._slot_shardings)
        self.table = update(self.table, jax.device_put(np.int32(row), self._replicated_row), slot)


def _update_slot(table, row, slot):
    """Every leaf's slot `row` replaced by `slot`'s (its slot axis of size 1), any non-finite value
    written as 0. The table only ever holds finite values: a batch of many tokens multiplies every
    slot's B (lora/ops.py's dense form) and one NaN there would reach every token, 0 x NaN being NaN.
    Adapters are checked finite before they get here (lora/manager.py); this is the second line."""
    def write(path, leaf, value):
        axis = SLOT_AXIS[rules.path_name(path)]
        value = jnp.where(jnp.isfinite(value), value, jnp.zeros_like(value))
        return jax.lax.dynamic_update_slice_in_dim(leaf, value, row, axis)
    return jax.tree_util.tree_map_with_path(write, table, slot)
