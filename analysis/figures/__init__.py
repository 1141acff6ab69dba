"""One module per figure, each `make(...) -> matplotlib Figure` with no I/O; `style.save` writes
PNG + PDF. Run-record figures take frames from analysis.load; the no-training figures take the
record lists of analysis.audit_schema (as lists of dicts or DataFrames).

    learning_curves   policy and EMA-anchor eval metric vs iteration (mean ± CI over seeds)
    training_dynamics KL value and anchor drift vs iteration
    ablation          final metric vs a knob (τ, period, k: lines; KL type: bars), with CIs
    estimator_bias    bias / variance of each KL estimator (log scale)
    topk_variance     Top-k KL variance vs k, sampled (k=0) to exact (k=|V|)
    anchor_horizon    EMA anchor half-life and time constant vs τ and period
    stability_region  stable (α, βc) region of the toy quadratic model per η
    beta_tau_map      heatmaps over (KL coef β, EMA τ): policy, anchor, paired gain over τ = 1 with CI
"""
