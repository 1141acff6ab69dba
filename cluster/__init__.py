"""Where emapg runs beyond one machine: Ray cluster configuration plus a thin submit helper.

    ray-cluster.yaml     `ray up` launcher config for cloud VMs with 8 GPUs per node
    slurm.sbatch         template: start a Ray head + workers on a SLURM allocation, run a command
    sites/<site>.yaml    per-site SLURM facts (partition, account, excluded nodes, setup lines)
    slurm.py             render slurm.sbatch from a site file (`emapg cluster slurm`)
    submit.py            `emapg cluster submit|status|logs|stop|list` through the Ray Jobs API

Nothing here imports torch or the core; ray is imported only inside the commands that talk to a
cluster.
"""
