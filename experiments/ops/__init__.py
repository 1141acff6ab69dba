"""What a user runs around training, beside it rather than inside it:

    doctor.py     `emapg doctor`: is this machine (or every node of a Ray cluster) ready for a config?
    data.py       `emapg data`: a task's data sets, prepared in the schema the trainer reads
    evaluate.py   `emapg eval`: saved models scored without training (the paper's protocols)
    rehearse.py   `emapg rehearse`: a GPU preset's real verl loop on CPU, killed and resumed, checked
    retrieval/    `emapg retriever`: the search tasks' retriever (BM25 or dense) as a local HTTP service

Training itself (config, composition, tasks, runs and their records, the backends) is the rest of `experiments`.
A sweep's rehearsal through Ray Tune is `sweeps.rehearse`, a layer above.
"""
