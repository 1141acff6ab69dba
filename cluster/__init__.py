"""Where emapg runs beyond one machine (docs/scaling-out.md): Ray cluster configuration, the SLURM launcher
(slurm.py renders slurm.sbatch from sites/<site>.yaml), `emapg cluster` through the Ray Jobs API (submit.py), and
the GPU install check. Nothing here imports the core; ray only inside the commands that talk to a cluster."""
