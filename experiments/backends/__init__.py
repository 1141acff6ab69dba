"""How a run config becomes a run on each backend. ``verl``: the compilation into a verl launch."""
