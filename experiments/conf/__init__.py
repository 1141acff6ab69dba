"""Hydra config tree (a package so Hydra can find it with initialize_config_module)."""
