"""EMA-PG core: KL estimators, Top-k machinery, the EMA anchor, GRPO loss and trainers.

Imports only torch/numpy (and transformers where a model is touched); no hydra/ray/pandas/wandb.
"""
