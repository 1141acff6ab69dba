"""Python values as Hydra command-line override values: the one formatter of the sweep trials
(``sweeps.spec``) and of the verl launch (``experiments.backends.verl.config``). Pure Python: no hydra, no omegaconf.

    hydra_value(None), hydra_value(True), hydra_value(1e-6)   # 'null', 'true', '1e-06'
    hydra_value("k3++"), hydra_value("True"), hydra_value("a b")   # "k3++", "'True'", "'a b'"
    hydra_value({"digits": 2, "ops": ["+", "-"]})   # "{digits:2,ops:['+','-']}"

Hydra's override parser reads the text back as exactly the value: None, bools, ints, floats (inf and nan
included), strings, lists/tuples (read back as lists) and dicts, nested. A string is left unquoted only
when Hydra reads it back as that same string; any other string is quoted, with Hydra's escapes (a
backslash is literal except before a quote or at the end). An interpolation ``${...}`` inside a string
is passed through: Hydra reads the same text and OmegaConf resolves it in the composed config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_./@+-]*")
"""Strings Hydra reads back as themselves unquoted: one identifier, or several tokens that it concatenates..."""
_KEYWORDS = ("true", "false", "null", "inf", "nan")
"""...except these, which Hydra reads (in any letter case) as a bool, None or a float."""
QUOTES = ("'", '"')


def hydra_value(v: Any, quote: str = "'") -> str:
    """`v` as the text after ``key=`` in a Hydra override. `quote`: the quote character strings get
    (the other one when the string contains only that one; ``"`` reads better inside shell single quotes)."""
    if quote not in QUOTES:
        raise ValueError(f"quote={quote!r}; allowed: {' '.join(QUOTES)}")
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Integral):
        return str(int(v))
    if isinstance(v, Real):
        return repr(float(v))  # 1e-06, 0.1, inf, -inf, nan: all read back as floats
    if isinstance(v, Mapping):
        return "{" + ",".join(f"{_key(k)}:{hydra_value(x, quote)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x, quote) for x in v) + "]"
    s = str(v)
    return s if _plain(s) else _quoted(s, quote)


def _plain(s: str) -> bool:
    return _PLAIN.fullmatch(s) is not None and s.lower() not in _KEYWORDS


def _quoted(s: str, quote: str) -> str:
    """`s` in quotes. Hydra un-escapes only backslashes that precede a quote (or the closing quote):
    there, n backslashes + a quote are written 2n + 1 backslashes + the quote, trailing ones doubled."""
    other = QUOTES[1 - QUOTES.index(quote)]
    q = other if quote in s and other not in s else quote
    s = re.sub(rf"(\\*){q}", lambda m: m.group(1) * 2 + "\\" + q, s)
    return q + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, s) + q


def _key(k: Any) -> str:
    """A dict key: Hydra's dict keys cannot be quoted, so a string key must read back unquoted."""
    if (isinstance(k, str) and _plain(k)) or k is None or isinstance(k, Real):  # Real: bools, ints, floats
        return hydra_value(k)
    raise ValueError(
        f"dict key {k!r} cannot be written in a Hydra override (keys are never quoted): use a "
        "name of letters, digits, _ . / @ + - starting with a letter or _, or a number"
    )
