"""The figures, each a function `(...) -> matplotlib Figure` with no I/O (`make` where a module holds one);
`style.save` writes PNG + PDF. Run-record figures take frames from analysis.load; `audit` takes audit records.
"""
