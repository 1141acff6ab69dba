"""sdpa in place of flash-attn for verl's packed batches (use_remove_padding) on one CUDA GPU: time and memory.

    python benchmarks/attention_packed.py --json /tmp/attention_packed.json   # on a GPU machine: measure
    python benchmarks/attention_packed.py --from-json F                        # anywhere: write the doc

With ``use_remove_padding=True`` verl packs a micro-batch into one row of N tokens (position ids restarting at 0
for each sequence), which transformers' sdpa masks to a block-diagonal causal N x N, while a varlen kernel attends
within each sequence only. Measured, forward + backward in bf16: one attention layer with Qwen2.5-7B's heads, and a
Qwen2.5-1.5B-shaped model, packed against the same sequences as a batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

try:  # a GPU install only
    import flash_attn
except ImportError:
    flash_attn = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common as C  # noqa: E402
from experiments.backends.verl import attention  # noqa: E402

SECTION = "sdpa for packed batches on a GPU"
HQ, HKV, D = 28, 4, 128  # Qwen2.5-7B's attention
CASES = [(16384, 1024), (16384, 4096), (8192, 512)]  # (N packed tokens, L tokens per sequence)
MODEL_CASES = [(16384, 1024)]
OURS = f"{attention.NAME} (the plugin's attention: torch varlen_attn behind transformers)"
OURS_MODEL = f"{attention.NAME}, packed (use_remove_padding)"
PER_SEQUENCE, BATCH = "sdpa, per sequence (is_causal, flash kernel)", "sdpa, (N/L, L) batch"  # the ratios' bases


def _packed_mask(n: int, seq: int) -> torch.Tensor:
    """(1, 1, N, N) bool: causal within each run of `seq` tokens (what transformers builds for sdpa)."""
    seg = torch.arange(n, device="cuda") // seq
    pos = torch.arange(n, device="cuda")
    return ((seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :]))[None, None]


def _per_sequence(q, k, v, seq: int) -> torch.Tensor:
    """(1, H, N, D) tensors as an (N/seq, H, seq, D) batch, causal attention within each row."""
    q, k, v = (t[0].reshape(t.shape[1], -1, seq, D).transpose(0, 1) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def attention_rows() -> list[dict]:
    module = SimpleNamespace(num_key_value_groups=HQ // HKV, is_causal=True, training=True)
    attention.register()
    rows = []
    for n, seq in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q0 = torch.randn(1, HQ, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k0 = torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v0 = torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
        mask = _packed_mask(n, seq)
        cu = torch.arange(0, n + 1, seq, device="cuda", dtype=torch.int32)
        pos = (torch.arange(n, device="cuda") % seq)[None]  # (1, N): verl's packed row

        def run(f, q0=q0, k0=k0, v0=v0):
            q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
            f(q, k, v).float().sum().backward()

        variants = {
            "sdpa, packed (block-diagonal mask)": lambda q, k, v, m=mask: sdpa_attention_forward(
                module, q, k, v, m, dropout=0.0
            )[0],
            PER_SEQUENCE: lambda q, k, v, s=seq: _per_sequence(q, k, v, s),
            OURS: lambda q, k, v, p=pos: attention.varlen_attention(module, q, k, v, None, position_ids=p)[0],
        }
        if attention.varlen_attn is not None:
            variants["torch varlen_attn (FlashAttention-2 in PyTorch)"] = lambda q, k, v, c=cu, s=seq: (
                attention.varlen_kernel(*(t[0].transpose(0, 1) for t in (q, k, v)), c, s)
            )
        if flash_attn is not None:
            variants["flash-attn flash_attn_varlen_func"] = lambda q, k, v, s=seq, c=cu: (
                flash_attn.flash_attn_varlen_func(*(t[0].transpose(0, 1) for t in (q, k, v)), c, c, s, s, causal=True)
            )
        for name, f in variants.items():
            try:
                ms, peak = C.timed_peak(lambda f=f: run(f))
                rows.append({"N": n, "L": seq, "variant": name, "ms": ms, "peak_GiB": peak})
            except Exception as e:  # noqa: BLE001 - a kernel this torch lacks is a row saying so
                rows.append({"N": n, "L": seq, "variant": name, "error": f"{type(e).__name__}: {e}"[:200]})
            torch.cuda.empty_cache()
        del q0, k0, v0, mask
    return rows


def model_rows() -> list[dict]:
    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    attention.register()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = []
    for n, seq in MODEL_CASES:
        ids = torch.randint(0, cfg.vocab_size, (n,), device="cuda")
        pos = (torch.arange(n, device="cuda") % seq)[None]

        def packed(ids=ids, pos=pos):
            return model(input_ids=ids[None], position_ids=pos, use_cache=False).logits

        def batch(ids=ids, seq=seq):
            return model(input_ids=ids.view(-1, seq), use_cache=False).logits

        variants = [("sdpa, packed (use_remove_padding)", "sdpa", packed), (BATCH, "sdpa", batch)]
        for name, attn, f in variants + [(OURS_MODEL, attention.NAME, packed)]:
            model.set_attn_implementation(attn)

            def step(f=f):
                model.zero_grad(set_to_none=True)
                f().float().mean().backward()

            ms, peak = C.timed_peak(step)
            rows.append({"N": n, "L": seq, "variant": name, "ms": ms, "peak_GiB": peak})
            torch.cuda.empty_cache()
        for name, attn in (("sdpa", "sdpa"), (attention.NAME, attention.NAME)):
            with torch.no_grad():
                model.eval()
                model.set_attn_implementation(attn)
                z = packed().view(-1, seq, cfg.vocab_size).float()
                model.set_attn_implementation("sdpa")
                diff = (z - batch().float()).abs().max().item()
                model.train()
            label = f"max abs logit difference, packed ({name}) vs batch"
            rows.append({"N": n, "L": seq, "variant": label, "value": diff})
            torch.cuda.empty_cache()
    return rows


def render(data: dict) -> str:
    m = data["machine"]
    lines = [
        f"Measured on {m['gpu']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"flash-attn {data.get('flash_attn') or 'not installed'}, driver {m['driver']} ({data['date']}): "
        "`python benchmarks/attention_packed.py --json F` there, then `--from-json F` here.",
        "",
        "| attention, one layer, 28/4 heads of 128, bf16, fwd + bwd | N | L | ms | peak GiB | × per sequence |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *_table(data["attention"], OURS, CASES, PER_SEQUENCE, ".2f"),
        "",
        "| Qwen2.5-1.5B shape, bf16, gradient checkpointing, fwd + bwd | N | L | ms | peak GiB | × batch |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *_table(data["model"], OURS_MODEL, MODEL_CASES, BATCH, ".0f"),
    ]
    lines += [""] + [f"- {n}" for n in data.get("notes", [])]  # added to the JSON by hand
    return "\n".join(lines).rstrip() + "\n"


def _table(rows: list[dict], ours: str, cases, base: str, ms: str) -> list[str]:
    """Rows of ms, peak GiB and ms over the `base` variant's at the same (N, L); or a row's error or value."""
    base_ms = {(r["N"], r["L"]): r["ms"] for r in rows if r["variant"] == base}
    out = []
    for r in _with_unmeasured(rows, ours, cases):
        head = f"| {r['variant']} | {r['N']} | {r['L']} |"
        if "value" in r:
            out.append(f"{head} {r['value']:.3g} | | |")
        elif "error" in r:
            out.append(f"{head} {r['error']} | | |")
        else:
            x = r["ms"] / base_ms.get((r["N"], r["L"]), float("nan"))
            out.append(f"{head} {r['ms']:{ms}} | {r['peak_GiB']:.2f} | {x:.2f} |")
    return out


def _with_unmeasured(rows: list[dict], variant: str, cases) -> list[dict]:
    """`rows`, plus a "not measured on a GPU yet" row for each case where `variant` has none (measurements made
    before it existed)."""
    have = {(r["N"], r["L"]) for r in rows if r["variant"] == variant}
    missing = [{"N": n, "L": seq, "variant": variant, "error": "not measured on a GPU yet"} for n, seq in cases]
    return rows + [r for r in missing if (r["N"], r["L"]) not in have]


def measure(data: dict, save) -> None:
    data.update(flash_attn=flash_attn.__version__ if flash_attn else None, attention=attention_rows())
    save(data)  # the attention rows survive a model run that does not finish
    data["model"] = model_rows()


def main() -> int:
    return C.gpu_main(SECTION, __doc__.splitlines()[0], render, measure)


if __name__ == "__main__":
    sys.exit(main())
