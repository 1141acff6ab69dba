"""Functions run in torch.multiprocessing.spawn children (importable by plain name via conftest)."""

import os

import torch

TAU = 0.9


def _models():
    from ema_pg_core.local.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    policy = build_model(tok, hidden=32, layers=2, heads=4, seed=1)
    anchor = build_model(tok, hidden=32, layers=2, heads=4, seed=2)
    return policy, anchor


def ema_worker(rank, world, port, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ema_pg_core.anchor import EmaAnchor, ema_update_
    from ema_pg_core.config import AnchorConfig
    from experiments.backends.verl.ema import drift, ema_update_sharded_, floating_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    policy, anchor = _models()
    # expected: the unsharded update on copies, and the unsharded drift after it
    exp_anchor = {n: t.detach().clone() for n, t in floating_state(anchor)}
    pol_full = {n: t.detach().clone() for n, t in floating_state(policy)}
    names = list(exp_anchor)
    ema_update_([exp_anchor[n] for n in names], [pol_full[n] for n in names], TAU)
    ref = EmaAnchor(policy, AnchorConfig(tau=TAU, period=1))
    ref.module.load_state_dict(anchor.state_dict())
    ref.update(1, policy)
    exp_drift = ref.drift(policy)

    mesh = init_device_mesh("cpu", (world,))
    for m in (policy, anchor):
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    local_shapes = {n: tuple(t.to_local().shape) for n, t in floating_state(anchor) if hasattr(t, "to_local")}
    ema_update_sharded_(anchor, policy, TAU)
    got = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for n, t in floating_state(anchor)}
    err = max((got[n] - exp_anchor[n]).abs().max().item() for n in names)
    d = drift(anchor, policy)
    if rank == 0:
        torch.save(
            {
                "err": err,
                "drift": d,
                "exp_drift": exp_drift,
                "names": sorted(got) == sorted(names),
                "local_shapes": local_shapes,
            },
            os.path.join(out_dir, "result.pt"),
        )
    dist.destroy_process_group()


def verl_engines_ema_worker(rank, world, port, model_path, out_dir):
    """verl's own actor and reference engines (FSDP2, world size `world`): shards line up and the
    local-shard EMA equals ema_update_ on the gathered tensors."""
    import cpu_shim
    import engines

    cpu_shim.install()
    cpu_shim.init_gloo(rank, world, port)
    from ema_pg_core.anchor import ema_update_
    from experiments.backends.verl.ema import drift, ema_update_sharded_

    actor = engines.training_worker(model_path, forward_only=False)
    ref = engines.training_worker(model_path, forward_only=True)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in actor.engine.module.parameters():
            p.to_local().add_(0.1 * torch.randn(p.to_local().shape, generator=g))
    full = lambda m: {n: p.full_tensor().clone() for n, p in m.named_parameters()}  # noqa: E731
    a, r = full(actor.engine.module), full(ref.engine.module)
    names = sorted(r)
    ema_update_([r[n] for n in names], [a[n] for n in names], TAU)
    ema_update_sharded_(ref.engine.module, actor.engine.module, TAU)
    got = full(ref.engine.module)
    err = max((got[n] - r[n]).abs().max().item() for n in names)
    d = drift(ref.engine.module, actor.engine.module)
    want = torch.sqrt(sum(((a[n] - r[n]) ** 2).sum() for n in names)).item()
    placements = {str(p.placements) for p in actor.engine.module.parameters()}
    if rank == 0:
        torch.save(
            {"err": err, "dist": d["anchor/dist"], "want": want, "placements": placements},
            os.path.join(out_dir, "result.pt"),
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def drop_count_worker(rank, world, port, model_path, out_dir):
    """DROP_KEY across data parallel: each rank masks out different rows; every rank's loss function
    must see global_batch_size = the kept sequences of all ranks (rank 0 keeps 3 of 4, rank 1 keeps 2)."""
    import cpu_shim
    import engines

    cpu_shim.install()
    cpu_shim.init_gloo(rank, world, port)
    from verl.utils import tensordict_utils as tu

    from experiments.backends.verl.engine import DROP_KEY, reclass

    actor = engines.training_worker(model_path, forward_only=False)
    reclass(actor.engine)
    seen = []

    def loss_fn(config=None, model_output=None, data=None, dp_group=None, **kw):
        seen.append(int(data["global_batch_size"]))
        return model_output["log_probs"].values().sum() * 0.0, {}

    actor.set_loss_fn(loss_fn)
    td, _ = engines.batch(seed=rank, drop=(1,) if rank == 0 else (0, 2))
    tu.assign_non_tensor(
        td,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=4,
        max_token_len_per_gpu=16,
        use_fused_kernels=False,
        **{DROP_KEY: True},
    )
    with actor.engine.train_mode():
        actor.engine.forward_backward_batch(td, loss_function=loss_fn, forward_only=False)
    torch.save(seen, os.path.join(out_dir, f"seen{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
