"""EMA on FSDP2 local shards (gloo, world size 1 and 2) equals the unsharded ema_pg_core update,
for plain fully_shard models and for verl's own actor/reference engines (world size 2).

Each world runs in fresh processes (torch.multiprocessing.spawn): both models are wrapped with
``fully_shard`` on a CPU mesh, ``ema_update_sharded_`` mixes the local shards, and the gathered
result is compared with ``ema_update_`` applied to unsharded copies (and ``EmaAnchor.drift``).
"""

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.verl


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_ema_equals_unsharded(world, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from spawned import ema_worker

    mp.spawn(ema_worker, args=(world, port, str(tmp_path)), nprocs=world, join=True)
    r = torch.load(tmp_path / "result.pt", weights_only=False)
    assert r["names"]
    assert r["err"] < 1e-6, r["err"]  # fp32 lerp on identical elements: only rounding of the cast-free op
    # world 2 really shards: the embedding's local shard is half of its rows
    if world == 2:
        assert r["local_shapes"]["model.embed_tokens.weight"][0] * 2 == 100
    assert r["drift"]["anchor/dist"] == pytest.approx(r["exp_drift"]["anchor/dist"], rel=1e-5)
    assert r["drift"]["anchor/drift"] == pytest.approx(r["exp_drift"]["anchor/drift"], rel=1e-5)


def test_mismatched_modules_are_refused():
    from experiments.backends.verl.ema import ema_update_sharded_

    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2, bias=False)
    with pytest.raises(ValueError, match="differ"):
        ema_update_sharded_(a, b, 0.9)
    a2 = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="shapes differ"):
        ema_update_sharded_(a, a2, 0.9)


@pytest.mark.parametrize("world", [2])
def test_ema_on_verl_engines(world, tmp_path, tiny_path):
    """The same on verl's FSDP2 actor/reference engines built by TrainingWorker (CPU shim, gloo)."""
    import socket

    from spawned import verl_engines_ema_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(verl_engines_ema_worker, args=(world, port, tiny_path, str(tmp_path)), nprocs=world, join=True)
    r = torch.load(tmp_path / "result.pt", weights_only=False)
    assert r["placements"] == {"(Shard(dim=0),)"}
    assert r["err"] < 1e-6, r["err"]
    assert r["dist"] == pytest.approx(r["want"], rel=1e-5)


def test_drop_key_counts_kept_sequences_over_data_parallel(tmp_path, tiny_path):
    """mask_truncated at world size 2: the seq-mean denominator is the kept count of both ranks."""
    import socket

    from spawned import drop_count_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(drop_count_worker, args=(2, port, tiny_path, str(tmp_path)), nprocs=2, join=True)
    seen = [torch.load(tmp_path / f"seen{r}.pt") for r in range(2)]
    assert seen[0] and seen[1] and set(seen[0]) == set(seen[1]) == {3 + 2}
