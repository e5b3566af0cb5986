"""The data-parallel router: a conversation's turns go where its prefix is, load spreads the rest."""

from __future__ import annotations

import random

import pytest

from orca_jax.engine.router import ReplicaRouter, prefix_keys


def test_keys_chain_every_token_before_a_page():
    a = prefix_keys(list(range(40)), 16)
    assert len(a) == 2  # 40 tokens: two full pages
    b = prefix_keys([99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # a change in page 0 changes every later key
    assert prefix_keys(list(range(40)), 16, salt=("adapter",)) != a
    assert prefix_keys(list(range(15)), 16) == []


def test_a_conversation_s_turns_go_to_the_replica_holding_its_prefix():
    router = ReplicaRouter(num_replicas=2, page_size=4)
    rng = random.Random(0)
    chats = {c: [rng.randrange(1000) for _ in range(12)] for c in range(6)}
    loads = [0, 0]
    first = {}
    for c, history in chats.items():  # all in flight at once
        first[c] = router.route(history, loads)
        loads[first[c]] += 1
    assert loads == [3, 3]  # new prefixes spread by load
    for turn in range(3):
        for c, history in chats.items():
            history += [rng.randrange(1000) for _ in range(9)]  # the reply and the next question
            assert router.route(history, [0, 0]) == first[c]
    assert router.affinity_hits == 18


def test_ties_go_round_the_replicas():
    router = ReplicaRouter(num_replicas=3, page_size=4)
    assert [router.route([i] * 8, [0, 0, 0]) for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_affinity_yields_to_a_replica_too_busy():
    router = ReplicaRouter(num_replicas=2, page_size=4, imbalance=2)
    hot = list(range(8))
    assert router.route(hot, [0, 0]) == 0
    assert router.route(hot + [7], [2, 0]) == 0  # within the imbalance: stays with its prefix
    assert router.route(hot + [8], [3, 0]) == 1  # 3 > 0 + 2: the idle replica, which now owns the prefix
    assert router.route(hot + [9], [3, 1]) == 1


def test_the_map_is_bounded():
    router = ReplicaRouter(num_replicas=3, page_size=2, max_keys=10)
    for i in range(50):
        router.route([i, i + 1, i + 2, i + 3], [0, 0, 0])
    assert router.num_keys == 10


def test_one_replica_is_refused_below_one():
    with pytest.raises(ValueError, match="num_replicas"):
        ReplicaRouter(num_replicas=0, page_size=16)


def _shared_owners(tmp_path, slots: int = 1024):
    from orca_jax.engine.router import SharedPrefixOwners
    from orca_jax.engine.shared_arrays import ArraySpec, SharedArrays

    specs = (ArraySpec("keys", "int64", (slots,)), ArraySpec("owners", "int64", (slots,)))
    path = str(tmp_path / "routing")
    SharedArrays.create(path, specs)
    # Two attachments of one file, as two API server processes map it.
    return [SharedPrefixOwners(SharedArrays.attach(path, specs)["keys"], SharedArrays.attach(path, specs)["owners"])
            for _ in range(2)]


def test_routers_sharing_a_map_send_a_chat_s_turns_to_one_replica_whichever_routes_them(tmp_path):
    first_owners, second_owners = _shared_owners(tmp_path)
    routers = [ReplicaRouter(num_replicas=2, page_size=4, owners=first_owners),
               ReplicaRouter(num_replicas=2, page_size=4, owners=second_owners)]
    rng = random.Random(1)
    chats = {c: [rng.randrange(1000) for _ in range(12)] for c in range(6)}
    loads, first = [0, 0], {}
    for c, history in chats.items():  # all in flight at once, the loads every API server's together
        first[c] = routers[c % 2].route(history, loads)
        loads[first[c]] += 1
    assert loads == [3, 3]
    for turn in range(3):
        for c, history in chats.items():
            history += [rng.randrange(1000) for _ in range(9)]
            assert routers[(c + turn + 1) % 2].route(history, [0, 0]) == first[c], (c, turn)
    assert routers[0].affinity_hits + routers[1].affinity_hits == 18


def test_prefix_keys_are_the_same_in_another_process():
    import json
    import subprocess
    import sys

    from orca_jax.engine.router import adapter_salt
    from orca_jax.lora.request import LoRARequest

    code = ("import json; from orca_jax.engine.router import prefix_keys, adapter_salt; "
            "from orca_jax.lora.request import LoRARequest; "
            "print(json.dumps(prefix_keys(list(range(40)), 16, adapter_salt(LoRARequest('sql', 1, '/a')))))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(other.stdout) == prefix_keys(list(range(40)), 16, adapter_salt(LoRARequest("sql", 1, "/a")))
