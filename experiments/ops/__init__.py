"""What a user runs around training, beside it rather than inside it: `emapg doctor` (doctor.py), `emapg data`
(data.py), `emapg eval` (evaluate.py), `emapg rehearse` (rehearse.py) and `emapg retriever` (retrieval/); each
module's docstring says what it does. A sweep's rehearsal through Ray Tune is `sweeps.rehearse`, a layer above.
"""
