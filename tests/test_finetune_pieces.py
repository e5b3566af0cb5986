"""A micro step in pieces of a few layers (finetune/pieces.py) computes what the whole micro step does:
the same loss and accumulated gradient on a tiny model; a job in pieces ends with the adapter of a job
without; and a job parked by a burst while a micro-batch is in pieces finishes that micro-batch first."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from finetune_helpers import FAST, RECORDS, drive, engine_config, packed_batch, upload
from hf_dirs import write_hf_dir
from orca_jax.engine import Engine
from orca_jax.finetune.adapter_params import init_adapter
from orca_jax.finetune.hparams import LoRASpec, resolve_targets
from orca_jax.finetune.offline import run_fine_tune
from orca_jax.finetune.pieces import Pieces
from orca_jax.finetune.trainer import LoRATrainer
from orca_jax.models.loader import load_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    write_hf_dir(directory, "llama")
    return load_model(directory)


def random_adapter(config, spec: LoRASpec) -> dict:
    """init_adapter's, with B drawn too: with B = 0 the gradient of A is 0 and would show nothing."""
    adapter = init_adapter(config, spec, seed=0)
    rng = np.random.default_rng(1)
    return jax.tree_util.tree_map(lambda x: rng.normal(0, 0.05, x.shape).astype(np.float32), adapter)


def test_pieces_compute_the_whole_micro_steps_loss_and_gradient(loaded, tmp_path):
    engine = Engine(engine_config(str(tmp_path)), loaded)
    stage, config = engine.runner.stages[0], engine.model_config
    spec = LoRASpec(4, 8.0, resolve_targets(None, config.family))
    batch = packed_batch()
    results = {}
    for layers_per_piece in (0, 1):
        trainer = LoRATrainer(stage.model, stage.params, spec, FAST, batch.token_ids.shape, 10, stage.replicated,
                              False, None, layers_per_piece)
        trainer.start_compiling(config).result()
        trainer.init_state(random_adapter(config, spec))
        pieces = 0
        out = trainer.run_piece(batch)
        while out is None:
            assert trainer.in_progress
            with pytest.raises(ValueError):
                trainer.park()  # not while its saved activations are in flight
            pieces, out = pieces + 1, trainer.run_piece()
        assert not trainer.in_progress
        results[layers_per_piece] = (float(out[0]), float(out[1]), trainer.park().accumulator, pieces)
    (loss, count, whole, _), (piece_loss, piece_count, pieced, num_pieces) = results[0], results[1]
    assert num_pieces == 2 * config.num_layers  # forwards, the loss, backwards; the first returned nothing
    assert piece_count == count and piece_loss == pytest.approx(loss, rel=1e-6)
    flat, flat_pieced = jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(pieced)
    assert any(np.abs(g).max() > 0 for g in flat)
    for g, p in zip(flat, flat_pieced):
        np.testing.assert_allclose(p, g, rtol=1e-5, atol=1e-7)


def test_layers_per_piece_must_divide_the_layers(loaded, tmp_path):
    with pytest.raises(ValueError, match="must divide"):
        Pieces(None, 1.0, num_layers=2, layers_per_piece=3)
    with pytest.raises(ValueError, match="must divide the model's 2 layers"):
        Engine(engine_config(str(tmp_path), layers_per_piece=3), loaded)


def test_a_job_in_pieces_learns_what_a_whole_job_does(loaded, tmp_path):
    whole = run_fine_tune(Engine(engine_config(str(tmp_path / "whole")), loaded), RECORDS, hyperparameters=FAST,
                          lora_request=None, rank=4, alpha=None, target_modules=None, suffix=None, use_tqdm=False)
    engine = Engine(engine_config(str(tmp_path / "pieces"), layers_per_piece=1), loaded)
    pieced = run_fine_tune(engine, RECORDS, hyperparameters=FAST, lora_request=None, rank=4, alpha=None,
                           target_modules=None, suffix=None, use_tqdm=False)
    from safetensors.numpy import load_file

    ours = load_file(os.path.join(pieced.lora_path, "adapter_model.safetensors"))
    theirs = load_file(os.path.join(whole.lora_path, "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-3, atol=1e-5, err_msg=name)
    # Every piece is a turn of its own: 2 x 2 layers + 1 per micro-batch.
    assert engine.stats().fine_tuning_iterations >= 5 * FAST.n_epochs


def test_the_flat_layout_round_trips_the_adapter_and_adamws_state():
    import optax

    from orca_jax.finetune.flat import FlatLayout

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
