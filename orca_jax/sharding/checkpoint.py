"""Restore a checkpoint written once (weights.save_params, stacked layout, one device) straight onto any mesh.

Every array is read shard by shard into the devices that own it (orbax restore args carrying each
array's NamedSharding), so no device, and no host buffer, ever holds the whole model:
- per-layer weights are restored stacked with the layer axis split over the mesh's stage axis, so a
  stage's devices read only their own layers, then cut into per-layer arrays on the stage's sub-mesh
  (rows `s:s+1` of the mesh, the (stage, tensor) axes kept) without leaving their devices;
- the vocabulary is padded during the read: orbax zero-fills rows past the saved shape (strict=False),
  after the saved shapes were checked against the model, so nothing else is padded or truncated;
- K/V projections that tensor_plan replicates are read split over stages only (all of a layer's few
  KV heads on each of the stage's devices) and repeated on device into their tensor sharding.
Peak device memory is the final params plus one stacked leaf's share: a leaf's stacked copy is
deleted as soon as its layers are cut out of it.

Non-layer params (embeddings, final norm, LM head) are placed on the whole mesh, replicated over stages.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from orca_jax.config import ModelConfig
from orca_jax.models import decoder
from orca_jax.models.weights import WeightsError
from orca_jax.sharding import rules
from orca_jax.sharding.mesh import STAGE, TENSOR
from orca_jax.sharding.tensor_plan import KV_HEAD_AXIS, TensorPlan, plan_for


def stage_meshes(mesh: Mesh) -> list[Mesh]:
    """One sub-mesh per pipeline stage: that stage's row of the (stage, tensor) mesh."""
    return [Mesh(mesh.devices[s:s + 1], mesh.axis_names) for s in range(mesh.shape[STAGE])]


def restore_sharded(path: str, config: ModelConfig, mesh: Mesh):
    """Device-layout params of `config` (vocab padded, KV heads replicated for the mesh's tensor size),
    each layer on its stage's sub-mesh; layer i belongs to stage i // (num_layers / num_stages)."""
    import orbax.checkpoint as ocp

    plan = plan_for(config, mesh.shape[TENSOR])
    num_stages = mesh.shape[STAGE]
    if config.num_layers % num_stages:
        raise ValueError(f"num_stages={num_stages} does not divide num_layers={config.num_layers}")
    path = os.path.abspath(path)
    _check_saved_shapes(path, config)
    targets = decoder.stacked_param_shapes(plan.device)
    read_as = jax.tree_util.tree_map_with_path(functools.partial(_read_args, plan, mesh), targets)
    with ocp.PyTreeCheckpointer() as checkpointer:
        stacked = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=read_as))
    stacked = jax.tree_util.tree_map_with_path(functools.partial(_replicate_kv, plan, mesh), stacked)
    params = {name: value for name, value in stacked.items() if name != "layers"}
    params["layers"] = _split_layers(stacked["layers"], mesh)
    return params


def _check_saved_shapes(path: str, config: ModelConfig) -> None:
    """Padding on read is on (strict=False), so a checkpoint of another model must be caught here."""
    import orbax.checkpoint as ocp

    if not os.path.isdir(path):
        raise WeightsError(f"{path}: no such checkpoint directory")
    with ocp.PyTreeCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(path)
    tree = getattr(metadata, "item_metadata", metadata)  # StepMetadata in newer orbax, the tree in older
    tree = getattr(tree, "tree", tree)
    saved = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(tree)}
    want = {jax.tree_util.keystr(k): tuple(v.shape)
            for k, v in jax.tree_util.tree_leaves_with_path(decoder.stacked_param_shapes(config))}
    if saved != want:
        wrong = sorted(k for k in saved.keys() | want.keys() if saved.get(k) != want.get(k))
        raise WeightsError(f"{path}: saved params do not fit the model config: "
                           + ", ".join(f"{k} saved {saved.get(k)}, needs {want.get(k)}" for k in wrong[:5]))


def _stacked_spec(name: str) -> P:
    """The leaf's spec in the stacked layout: layers over stages, the rest as rules.PARAM_SPECS says."""
    spec = rules.PARAM_SPECS[name]
    return P(STAGE, *spec) if name.startswith("layers/") else spec


def _read_args(plan: TensorPlan, mesh: Mesh, path, target: jax.ShapeDtypeStruct):
    import orbax.checkpoint as ocp

    name = rules.path_name(path)
    spec = _stacked_spec(name)
    shape = target.shape
    if name in KV_HEAD_AXIS and plan.kv_repeat > 1:
        # Read the model's K heads, unsplit over the tensor axis; _replicate_kv repeats them.
        spec = P(*(None if axis == TENSOR else axis for axis in spec))
        shape = shape[:-2] + (plan.model.num_kv_heads, shape[-1])
    return ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, spec), global_shape=shape, dtype=target.dtype,
                                strict=False)  # zero-fills the padded vocabulary; shapes checked first


def _replicate_kv(plan: TensorPlan, mesh: Mesh, path, x: jax.Array) -> jax.Array:
    name = rules.path_name(path)
    if name not in KV_HEAD_AXIS or plan.kv_repeat == 1:
        return x
    target = NamedSharding(mesh, _stacked_spec(name))
    out = jax.jit(functools.partial(jnp.repeat, repeats=plan.kv_repeat, axis=KV_HEAD_AXIS[name]),
                  out_shardings=target)(x)
    x.delete()
    return out


def _split_layers(stacked_layers, mesh: Mesh) -> list:
    """Stacked leaves split over stages -> one dict per layer on its stage's sub-mesh, no data moved
    between devices: each stage's shards are viewed as a stacked array on the stage's sub-mesh (no
    copy), which one small program per stage cuts into its layers."""
    subs = stage_meshes(mesh)
    num_layers = jax.tree_util.tree_leaves(stacked_layers)[0].shape[0]
    per_stage = num_layers // len(subs)

    def split(path, x: jax.Array) -> list[jax.Array]:
        spec = rules.PARAM_SPECS["layers/" + rules.path_name(path)]
        shards = {shard.device: shard.data for shard in x.addressable_shards}  # each [per_stage, ...]
        layers, views = [], []
        for sub in subs:
            stage_sharding = NamedSharding(sub, P(None, *spec))
            view = jax.make_array_from_single_device_arrays(  # [per_stage, ...] on the stage's devices
                (per_stage, *x.shape[1:]), stage_sharding, [shards[d] for d in stage_sharding.addressable_devices])
            cut = jax.jit(lambda v: tuple(v[j] for j in range(per_stage)),
                          out_shardings=(NamedSharding(sub, spec),) * per_stage)
            layers.extend(cut(view))
            views.append(view)
        jax.block_until_ready(layers)
        x.delete()  # bounds the peak: one leaf's stacked copy at a time (the views share its buffers)
        return layers

    split_leaves = jax.tree_util.tree_map_with_path(split, stacked_layers)
    return [jax.tree_util.tree_map(lambda layers, i=i: layers[i], split_leaves,
                                   is_leaf=lambda v: isinstance(v, list)) for i in range(num_layers)]


def gather_model_params(params, config: ModelConfig, tensor_parallel: int):
    """Device params (any mesh) -> the model's stacked numpy params, e.g. to save them again."""
    plan = plan_for(config, tensor_parallel)
    return plan.model_params(decoder.stack_layers(jax.tree_util.tree_map(np.asarray, params)))
