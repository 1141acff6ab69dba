"""The engine's Top-k outputs (pi_old's own top-k; the anchor's gather at those ids) equal the naive
computation from a plain forward of the same tiny Qwen2, for both of verl's input layouts and a
non-unit temperature; verl's own log-probs are unchanged by our engine class."""

import engines
import pytest
import torch

pytestmark = pytest.mark.verl
K = 5


LAYOUTS = {  # (remove_padding, micro-batch size, dynamic token budget)
    "remove_padding": (True, 4, None),
    "padded": (False, 4, None),
    "dynamic_micro_batches": (True, 1, 16),  # several micro-batches, re-ordered by verl and restored
}


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def workers(request, tiny_path):
    from experiments.backends.verl.engine import reclass

    rmpad, micro, tokens = LAYOUTS[request.param]
    actor = engines.training_worker(
        tiny_path, forward_only=False, remove_padding=rmpad, micro=micro, dynamic_tokens=tokens
    )
    ref = engines.training_worker(
        tiny_path, forward_only=True, remove_padding=rmpad, micro=micro, dynamic_tokens=tokens
    )
    with torch.no_grad():  # make the anchor differ from the policy
        for p in ref.engine.module.parameters():
            p.to_local().mul_(0.9)
    base_lp = actor.infer_batch(engines.batch(temperature=0.7)[0])["log_probs"]
    reclass(actor.engine)
    reclass(ref.engine)
    return actor, ref, base_lp


def _full(module):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in module.state_dict().items()}


def _plain_copy(tiny_path, worker):
    m = engines.plain_model(tiny_path)
    m.load_state_dict(_full(worker.engine.module), strict=False)
    return m.eval()


def test_topk_outputs_equal_naive(workers, tiny_path):
    from verl.workers.utils.padding import no_padding_2_padding

    from experiments.backends.verl.engine import set_pass

    actor, ref, base_lp = workers
    T = 0.7
    td, padded = engines.batch(temperature=T)
    mask = padded["response_mask"].bool()
    set_pass(td, "self", k=K, prefix="emapg_old_")
    out = actor.infer_batch(td)
    # verl's own outputs are untouched by the subclass
    assert torch.equal(out["log_probs"].values(), base_lp.values())
    R = lambda key: no_padding_2_padding(out[key], td)  # noqa: E731

    with torch.no_grad():
        z = engines.naive_logits(_plain_copy(tiny_path, actor), padded, T)  # (B, R, V)
    top = torch.topk(z, K, dim=-1)
    ids = R("emapg_old_topk_ids")
    assert ids.dtype == torch.int32 and ids.shape == (4, engines.R, K)
    assert torch.equal(ids.long()[mask], top.indices[mask])
    torch.testing.assert_close(R("emapg_old_logits_k")[mask], top.values[mask], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(R("emapg_old_lse")[mask], torch.logsumexp(z, -1)[mask], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        R("log_probs")[mask],
        torch.log_softmax(z, -1).gather(-1, padded["responses"][..., None])[..., 0][mask],
        atol=2e-5,
        rtol=1e-5,
    )

    # the anchor gathers at pi_old's ids (carried as a nested (nnz, K) field, as TransferQueue does)
    td2, _ = engines.batch(temperature=T)
    td2["emapg_old_topk_ids"] = out["emapg_old_topk_ids"]
    set_pass(td2, "gather", ids_key="emapg_old_topk_ids", prefix="emapg_ref_")
    out2 = ref.infer_batch(td2)
    with torch.no_grad():
        zr = engines.naive_logits(_plain_copy(tiny_path, ref), padded, T)
    assert "emapg_ref_topk_ids" not in out2.keys()
    got_k = no_padding_2_padding(out2["emapg_ref_logits_k"], td2)
    torch.testing.assert_close(got_k[mask], zr.gather(-1, top.indices)[mask], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        no_padding_2_padding(out2["emapg_ref_lse"], td2)[mask], torch.logsumexp(zr, -1)[mask], atol=2e-5, rtol=1e-5
    )


def test_pass_off_is_plain_verl(workers):
    actor, _, base_lp = workers
    out = actor.infer_batch(engines.batch(temperature=0.7)[0])
    assert sorted(k for k in out.keys() if k != "metrics") == ["log_probs"]
    assert torch.equal(out["log_probs"].values(), base_lp.values())


def test_reclass_refuses_other_engines():
    from experiments.backends.verl.engine import reclass

    with pytest.raises(TypeError, match="FSDPEngineWithLMHead"):
        reclass(object())


def _pass(worker, mode, carry=None, **flags):
    """The tensors a pass adds (prefix "p_"), on the fixed test batch at temperature 0.7."""
    from experiments.backends.verl.engine import set_pass

    td, _ = engines.batch(temperature=0.7)
    td.update(carry or {})
    set_pass(td, mode, prefix="p_", **flags)
    out = worker.infer_batch(td)
    return {k: out[k] for k in out.keys() if k.startswith("p_")}


def _same(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a.offsets(), b.offsets()) and torch.equal(a.values(), b.values())


def test_ids_mode_and_logp_flag_send_exactly_what_self_and_gather_would(workers):
    """Mode "ids" sends mode "self"'s ids and nothing else; with ``logp`` the "self" and "gather" passes send,
    bit for bit, logits_k - lse (fp32) in place of the two."""
    actor, ref, _ = workers
    full = _pass(actor, "self", k=K)
    ids = _pass(actor, "ids", k=K)
    assert ids.keys() == {"p_topk_ids"} and _same(ids["p_topk_ids"], full["p_topk_ids"])
    own = _pass(actor, "self", k=K, logp=True)
    assert own.keys() == {"p_topk_ids", "p_logp_k"} and _same(own["p_topk_ids"], full["p_topk_ids"])
    expect = full["p_logits_k"].values() - full["p_lse"].values()[:, None]
    assert torch.equal(own["p_logp_k"].values(), expect) and own["p_logp_k"].dtype == torch.float32

    carry = {"emapg_old_topk_ids": ids["p_topk_ids"]}
    gathered = _pass(ref, "gather", carry, ids_key="emapg_old_topk_ids")
    as_logp = _pass(ref, "gather", carry, ids_key="emapg_old_topk_ids", logp=True)
    assert as_logp.keys() == {"p_logp_k"}
    assert torch.equal(
        as_logp["p_logp_k"].values(), gathered["p_logits_k"].values() - gathered["p_lse"].values()[:, None]
    )


def test_ids_mode_breaks_ties_as_self_does(tiny_path):
    """Logits with ties at the head's cut: 50 of the 100 vocabulary rows of the (tied) LM head are zero, so each
    position has 50 logits exactly 0 and a top-40 that ends inside them; "ids" keeps the same of them as "self"."""
    from experiments.backends.verl.engine import reclass

    worker = engines.training_worker(tiny_path, forward_only=True)
    with torch.no_grad():
        worker.engine.module.lm_head.weight.to_local()[50:] = 0.0
    reclass(worker.engine)
    k = 40
    full = _pass(worker, "self", k=k)
    last = full["p_logits_k"].values()[:, -1]  # the k-th largest logit of each position
    assert bool((last == 0).any())  # the cut falls inside the run of 50 equal logits
    assert _same(_pass(worker, "ids", k=k)["p_topk_ids"], full["p_topk_ids"])
