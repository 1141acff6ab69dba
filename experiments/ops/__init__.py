"""What a user runs around training, beside it rather than inside it: `emapg doctor` (doctor.py), `emapg data`
(data.py), `emapg eval` (evaluate.py), `emapg rehearse` (rehearse/: one configuration, or a sweep through
Ray Tune in rehearse/sweep.py) and `emapg retriever` (retrieval/); each module's docstring says what it does.
"""
