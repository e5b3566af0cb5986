"""The adapter, its gradient accumulator and AdamW's moments on the device as one fp32 vector each.

Why: the peft-layout tree has two arrays per adapted module per layer (448 for llama-8b's seven
modules over 32 layers), and a compiled program's call handles every argument and result array on the
host. On an H100 (llama-8b, 512 tokens) the micro step's call took 11.4 ms to return, of a 48.2 ms
step, with the adapter, the accumulator and the result as trees; as vectors, 3.6 ms of 43.7 ms
(benchmarks/probes/pieces_cost.json). The tree is rebuilt inside the programs (static slices, free)
and on the host wherever a person or peft sees it (checkpoints, the finished adapter), so the
on-disk layout is the tree's. Layer i's arrays are contiguous, in layer order.
"""

from __future__ import annotations

import math

import jax
import numpy as np


class FlatLayout:
    """Where each array of a tree of fp32 arrays lies in one vector."""

    def __init__(self, template):
        """`template`: the tree (arrays or ShapeDtypeStructs)."""
        leaves, self.treedef = jax.tree_util.tree_flatten(template)
        self.shapes = [tuple(leaf.shape) for leaf in leaves]
        sizes = [math.prod(shape) for shape in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        self.size = self.offsets[-1]  # elements of the vector

    def ravel(self, tree, xp=np):
        """The tree's arrays, in order, as one f32[size] vector (xp: numpy on the host, jnp in a program)."""
        leaves = self.treedef.flatten_up_to(tree)
        if xp is np:  # each leaf copied once, into its place (astype and concatenate copied it twice)
            out = np.empty(self.size, np.float32)
            for leaf, start, end in zip(leaves, self.offsets, self.offsets[1:]):
                out[start:end] = np.ravel(leaf)
            return out
        return xp.concatenate([xp.reshape(leaf, (-1,)).astype(np.float32) for leaf in leaves])

    def unravel(self, vector, xp=np):
        """f32[size] -> the tree."""
        return jax.tree_util.tree_unflatten(self.treedef, [
            xp.reshape(vector[start:end], shape)
            for start, end, shape in zip(self.offsets, self.offsets[1:], self.shapes)])

    def is_tree(self, node) -> bool:
        """Whether `node` has this layout's structure (a moment in a tree-layout optimizer state)."""
        try:
            return jax.tree_util.tree_structure(node) == self.treedef
        except TypeError:
            return False

    def is_vector(self, node) -> bool:
        return getattr(node, "shape", None) == (self.size,)

    def state_to_vectors(self, state, xp=np):
        """An optimizer state made for the tree -> the same state for the vector."""
        return jax.tree_util.tree_map(lambda node: self.ravel(node, xp) if self.is_tree(node) else node, state,
                                      is_leaf=self.is_tree)

    def state_to_trees(self, state, xp=np):
        """An optimizer state made for the vector -> the same state for the tree."""
        return jax.tree_util.tree_map(lambda node: self.unravel(node, xp) if self.is_vector(node) else node, state)
