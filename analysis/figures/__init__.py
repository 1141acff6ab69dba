"""One module per run-record figure, each `make(...) -> matplotlib Figure` with no I/O (frames from analysis.load);
the no-training figures are the functions of `audit`. `style.save` writes PNG + PDF.

    learning_curves   policy and EMA-anchor eval metric vs iteration (mean ± CI over seeds)
    training_dynamics KL value and anchor drift vs iteration
    ablation          final metric vs a knob (τ, period, k: lines; KL type: bars), with CIs
    audit             from audit records: KL-estimator bias and variance, Top-k KL vs k, the EMA anchor's
                      horizon, our toy model's stability region
    beta_tau_map      heatmaps over (KL coef β, EMA τ): policy, anchor, paired gain over τ = 1 with CI
"""
