"""The figures, each a function `(...) -> matplotlib Figure` with no I/O (`make` where a module holds one);
`style.save` writes PNG + PDF. Run-record figures take frames from analysis.load.

    curves            vs iteration, mean ± CI over seeds: learning curves (policy and EMA anchor), training
                      dynamics (KL value, anchor drift), the exact KL beside its estimate on the probe
    ablation          final metric vs a knob (τ, period, k: lines; KL type: bars), with CIs
    beta_tau_map      heatmaps over (KL coef β, EMA τ): policy, anchor, paired gain over τ = 1 with CI
    topk_coverage     Top-k head mass and coverage vs k
    audit             from audit records (no training): KL-estimator bias and variance, Top-k KL vs k, the EMA
                      anchor's horizon, our toy model's stability region
"""
