"""The trainer's state as vectors (finetune/flat.py): the layout round-trips the adapter tree and
AdamW's state, and on the device a job's adapter, accumulator and moments are one array each (the
trainer's own results against the trees are in test_grad, test_offline and test_kv_loan)."""

from __future__ import annotations

import jax
import numpy as np
import optax

from orca_jax.engine import Engine
from orca_jax.finetune.adapter_params import init_adapter
from orca_jax.finetune.flat import FlatLayout
from orca_jax.finetune.hparams import LoRASpec, resolve_targets
from orca_jax.finetune.trainer import LoRATrainer
from orca_jax.models.loader import load_model

from tests.helpers.finetune import FAST, engine_config
from tests.helpers.hf_dirs import write_hf_dir


def test_the_flat_layout_round_trips_the_adapter_and_adamws_state():
    rng = np.random.default_rng(0)
    tree = {"layers": [{"q": {"a": rng.normal(size=(2, 3)).astype(np.float32),
                              "b": rng.normal(size=(5, 2)).astype(np.float32)}} for _ in range(3)]}
    layout = FlatLayout(tree)
    vector = layout.ravel(tree)
    assert vector.shape == (layout.size,) == (3 * (6 + 10),)
    np.testing.assert_array_equal(vector[6:16], tree["layers"][0]["q"]["b"].ravel())  # layer 0 first, in order
    for a, b in zip(jax.tree_util.tree_leaves(layout.unravel(vector)), jax.tree_util.tree_leaves(tree)):
        np.testing.assert_array_equal(a, b)
    tx = optax.adamw(1e-2)
    state = tx.init(tree)
    state = jax.tree_util.tree_map(lambda x: x + 1.5 if x.ndim else x, state)  # moments worth telling apart
    flat_state = layout.state_to_vectors(state)
    assert jax.tree_util.tree_structure(flat_state) == jax.tree_util.tree_structure(tx.init(vector))
    back = layout.state_to_trees(jax.device_get(flat_state))
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(state)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_trainers_state_is_three_vectors_and_checkpoints_as_trees(tmp_path):
    directory = str(tmp_path / "model")
    write_hf_dir(directory, "llama")
    engine = Engine(engine_config(str(tmp_path / "jobs")), load_model(directory))
    stage, config = engine.runner.stages[0], engine.model_config
    spec = LoRASpec(4, 8.0, resolve_targets(None, config.family))
    trainer = LoRATrainer(stage.model, stage.params, spec, FAST, (1, 32), 10, stage.replicated, False)
    trainer.start_compiling().result()
    start = init_adapter(config, spec, seed=0)
    trainer.init_state(start)
    moments = [x for x in jax.tree_util.tree_leaves(trainer.opt_state) if x.ndim]
    assert trainer.adapter.ndim == 1 and len(moments) == 2  # adapter; AdamW's mu and nu
    parked = trainer.park()  # parks as vectors; a checkpoint of it is in the tree's layout
    assert trainer.adapter is None and parked.adapter.shape == (trainer._layout.size,)
    adapter, opt_leaves = trainer.state_to_host(parked)
    assert jax.tree_util.tree_structure(adapter) == jax.tree_util.tree_structure(start)
    for a, b in zip(jax.tree_util.tree_leaves(adapter), jax.tree_util.tree_leaves(start)):
        np.testing.assert_array_equal(a, b)
    # The saved optimizer state is in the tree's layout: as many arrays as AdamW keeps for the tree.
    assert len(opt_leaves) == len(jax.tree_util.tree_leaves(jax.eval_shape(optax.adamw(1e-3).init, start))) + 1
    trainer.unpark(parked)
    assert trainer.adapter.sharding == stage.replicated and trainer.state_to_host()[0].keys() == adapter.keys()
