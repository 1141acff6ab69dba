"""ema_pg_core/local."""
