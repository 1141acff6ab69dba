"""The EMA update after verl offloaded the actor to host memory (needs a CUDA device; not run on CPU machines).

verl offloads the actor with ``module.to("cpu", non_blocking=True)`` (``offload_fsdp2_model_to_cpu``); the host
copies hold the values only once the copies finished. ``worker.wait_for_offload`` synchronises before the EMA
update and ``anchor_in_actor`` read them. Here the actor's weights are large enough (64M floats) for the copy to
still be running when the host reads start: the anchor after the update must equal the EMA of the weights as they
were on the device (to float32 rounding; a read before the copy finished sees other values).
"""

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.gpu]
TAU = 0.9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")  # -m gpu selects it on a GPU machine
def test_the_anchor_after_an_offloaded_update_is_the_ema_of_the_on_device_weights():
    from verl.utils.fsdp_utils import offload_fsdp2_model_to_cpu

    from ema_pg_core.verl.ema import ema_update_sharded_
    from ema_pg_core.verl.worker import wait_for_offload

    torch.manual_seed(0)
    actor = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)]).cuda()  # 67M parameters
    anchor = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)])  # on the host, as verl's ref
    with torch.no_grad():
        for p in actor.parameters():
            p.mul_(3.0).add_(1.0)  # device work queued right before the offload, as after an optimizer step
    on_device = [p.detach().clone() for p in actor.parameters()]
    before = [p.detach().clone() for p in anchor.parameters()]
    offload_fsdp2_model_to_cpu(actor, empty_cache=False)
    wait_for_offload()
    ema_update_sharded_(anchor, actor, TAU)
    for a, b, p in zip(anchor.parameters(), before, on_device):
        torch.testing.assert_close(a, torch.lerp(b, p.cpu(), 1 - TAU), rtol=1e-6, atol=1e-6)
