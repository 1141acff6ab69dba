"""The CLI's one error path: what each kind of exception means to the user, and its exit code.

    user error   bad config field, file, path or port     one line, exit 2
    run failed   a run that started, then failed           one line, exit 1 (the run record has the rest)
    interrupted  SIGINT / SIGTERM, after a checkpoint      one line + the resume command, exit 130 / 143
    unhealthy    a health rule ended the run               one line (rule, iteration, values), exit 3
    bug          anything else                              Python's traceback, exit 1

``EMAPG_DEBUG=1`` prints the traceback of every error too. Hydra's composition errors are turned
into user errors here (``hydra_message``), with a "did you mean" for near-misses, and so is every pydantic
ValidationError (``validation_line``: the field path, what is wrong, what is allowed; a sweep spec's too).
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import reprlib
import signal
import sys
import traceback


class UserError(ValueError):
    """Bad input, refused before any work: the message names the field or file and what is allowed."""


class RunFailed(RuntimeError):
    """A run that started and then failed for a reason other than a bug here (its message says why)."""


class RecordWriteError(RunFailed):
    """The run record could not be written (a full disk, a read-only directory): the path and the OS error."""


class RunInterrupted(Exception):
    """A run stopped by SIGINT or SIGTERM; its record says ``interrupted`` and a checkpoint may be on disk."""

    def __init__(self, message: str, signame: str, run_dir=None):
        super().__init__(message)
        self.signame, self.run_dir = signame, run_dir

    def __reduce__(self):  # crosses process boundaries intact (a sweep trial's Ray worker -> Tune)
        return type(self), (str(self), self.signame, self.run_dir)


class StoppedUnhealthy(Exception):
    """A run ended by an RL-health rule (ema_pg_core.health); its record says ``stopped_unhealthy`` and its
    summary.json["health"] holds `breach` ({"rule", "iteration", "message", "values"})."""

    def __init__(self, message: str, breach: dict, run_dir=None):
        super().__init__(message)
        self.breach, self.run_dir = breach, run_dir

    def __reduce__(self):  # crosses process boundaries intact (a sweep trial's Ray worker -> Tune)
        return type(self), (str(self), self.breach, self.run_dir)


class Terminated(BaseException):
    """SIGTERM outside the trainer's own handler (e.g. while the model loads): like KeyboardInterrupt."""


def exit_code_of_signal(signame: str) -> int:
    """128 + the signal number (the shell convention): SIGINT -> 130, SIGTERM -> 143."""
    return 128 + int(getattr(signal, signame, signal.SIGTERM))


def raise_terminated(signum, frame) -> None:
    """A SIGTERM handler: unwind like Ctrl-C does (records are closed as ``interrupted``)."""
    raise Terminated(signal.Signals(signum).name)


SHOWN_CHARS = 200  # the longest a value is shown in an error message (``shown``)
MESSAGE_CHARS = 2000  # the longest a line of an error message is printed (``handle``); the rest is counted


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """repr(value) for an error message, at most `limit` characters: reprlib's bounded repr (the first items
    of each container, a few levels deep), so a huge value is never formatted whole."""
    r = reprlib.Repr()
    r.maxlevel = 3
    r.maxlist = r.maxtuple = r.maxset = r.maxfrozenset = r.maxdeque = r.maxdict = 20
    r.maxstring = r.maxlong = r.maxother = limit
    text = r.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bounded(message: str, limit: int = MESSAGE_CHARS) -> str:
    """`message` with each line cut to `limit` characters and the cut counted."""
    return "\n".join(
        line if len(line) <= limit else f"{line[:limit]}... ({len(line) - limit:,} more characters)"
        for line in message.split("\n")
    )


def undecodable(exc: UnicodeDecodeError) -> str:
    """'not a text file (byte 0xf8 at offset 8 is not UTF-8)': the message for a file that is not text."""
    return f"not a text file (byte 0x{exc.object[exc.start]:02x} at offset {exc.start} is not {exc.encoding.upper()})"


def is_path_error(exc: BaseException) -> bool:
    """An OS error saying a path given is unusable (missing, read-only, full, too long): the user's to fix."""
    missing = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
    unusable = (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.EACCES)
    return isinstance(exc, missing) or (isinstance(exc, OSError) and exc.errno in unusable)


def os_reason(exc: OSError) -> str:
    """'<file>: <the OS's reason>' of an OSError (its message where it has no reason, no file where none)."""
    where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
    return f"{where}{exc.strerror or exc}"


RAY_TOKEN_AUTH_DOCS = "https://docs.ray.io/en/latest/ray-security/token-auth.html"
_RAY_AUTH_TEXTS = (
    "InvalidAuthToken",  # ray.init against the GCS
    "Authentication token is missing or incorrect",
    "Invalid authentication token",  # the Jobs API (dashboard)
    "Missing authentication token",
)


def is_ray_auth_error(exc: BaseException | None) -> bool:
    """Ray refused a connection on its token authentication (``RAY_AUTH_MODE=token``, Ray's default since 2.5x):
    the Jobs API's error, or ``ray.init``'s ConnectionError raised from the GCS's refusal (so the whole chain of
    causes is read). Ray is not imported for this: if it is not loaded, it raised nothing."""
    auth = getattr(sys.modules.get("ray.exceptions"), "AuthenticationError", ())
    seen = set()
    while exc is not None and id(exc) not in seen:
        if (auth and isinstance(exc, auth)) or any(s in str(exc) for s in _RAY_AUTH_TEXTS):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def ray_auth_line(where: str, who: str) -> str:
    """One line for a refused token (`where`: the address flag and value; `who`: driver, client): where the
    token must come from, or how to run without one."""
    return (
        f"{where}: the Ray cluster refused this {who}'s authentication token (the cluster runs Ray's token "
        "authentication); give this process the cluster's token: RAY_AUTH_MODE=token and "
        "RAY_AUTH_TOKEN_PATH=<the token file the head's `ray start` wrote, ~/.ray/auth_token of its user> or "
        "RAY_AUTH_TOKEN=<token>; or start every node and the driver with RAY_AUTH_MODE=disabled on a private "
        f"network ({RAY_TOKEN_AUTH_DOCS})"
    )


def classify(exc: BaseException) -> tuple[str, int] | None:
    """(one-line message, exit code) for an exception the user can act on; None for a bug."""
    if isinstance(exc, RunInterrupted):
        return str(exc), exit_code_of_signal(exc.signame)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT)", 130
    if isinstance(exc, Terminated):
        return "interrupted (SIGTERM)", 143
    if isinstance(exc, RunFailed):
        return f"run failed: {exc}", 1
    if isinstance(exc, StoppedUnhealthy):
        return f"stopped unhealthy: {exc}", 3  # neither a failure (1) nor bad input (2): scripts can tell it
    if _is_hydra(exc):
        return f"error: {hydra_message(exc)}", 2
    if type(exc).__module__.startswith("pydantic"):
        return f"error: {validation_line(exc)}", 2
    if isinstance(exc, (ValueError, KeyError)) and not isinstance(exc, UnicodeError):
        return f"error: {exc.args[0] if isinstance(exc, KeyError) and exc.args else exc}", 2
    if is_path_error(exc):
        return f"error: {os_reason(exc)}", 2
    if isinstance(exc, ImportError) and exc.name is None:  # an optional extra that is not installed: the hint
        return f"error: {exc}", 2
    return None


def handle(prog: str, exc: BaseException) -> int:
    """Print `exc` the way its kind asks for (see the module docstring); return the exit code."""
    kind = classify(exc)
    if kind is None or os.environ.get("EMAPG_DEBUG"):
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    if kind is None:
        return 1
    message, code = kind
    print(bounded(f"{prog}: {message}"), file=sys.stderr)
    return code


# ---------------------------------------------------------------- Hydra's errors in the user's words


def _is_hydra(exc: BaseException) -> bool:
    return type(exc).__module__.startswith(("hydra", "omegaconf"))


def hydra_message(exc: BaseException, keys=()) -> str:
    """One line for a Hydra/OmegaConf composition error: the field, what was wrong, what is allowed. `keys` lists
    the schema's dotted keys, for the "did you mean" (``experiments.build.compose`` passes the run schema's)."""
    cause = exc.__cause__ or exc
    text = str(cause)
    full_key = getattr(cause, "full_key", None)
    name = type(exc).__name__
    if name == "MissingConfigException":  # a group's option: Hydra lists the group's options
        group, _, option = (exc.missing_cfg_file or "?/?").rpartition("/")
        allowed = exc.options or []
        return f"{group}={option!r} is not an option; allowed: {', '.join(allowed)}{_near(option, allowed)}"
    if name == "OverrideParseException":
        return (
            f"cannot parse the override ({text.splitlines()[0]}); overrides are key=value, "
            "see https://hydra.cc/docs/advanced/override_grammar/basic/"
        )
    if type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError") and full_key:
        return _unknown_key(full_key, keys)
    if type(cause).__name__ == "ValidationError":
        what = text.splitlines()[0]
        return f"{full_key or 'a config value'}: {_plain(what)}"
    return text.splitlines()[0] if text else type(exc).__name__


def _unknown_key(full_key: str, keys: list[str]) -> str:
    """ "trainer.iteratons is not a config key; did you mean trainer.iterations?" (+ the section's keys)."""
    parent, _, leaf = full_key.rpartition(".")
    if parent in keys:  # a mapping field (e.g. task.knobs): its keys are added, not overridden
        return f"{parent} holds free-form keys: add one with +{full_key}=<value>"
    if parent:
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    else:  # top level: plain keys and sections (every config group is a section)
        siblings = list(dict.fromkeys(k.split(".")[0] for k in keys))
    if not siblings:  # an unknown section: compare whole keys
        return f"{full_key} is not a config key{_near(full_key, keys, 0.8)}"
    near = _near(leaf, siblings)
    where = f"keys of {parent}" if parent else "top-level keys"
    return (
        f"{full_key} is not a config key{near.replace('mean ', f'mean {parent}.' if parent else 'mean ')}; "
        f"{where}: {', '.join(siblings)}"
    )


def _plain(what: str) -> str:
    """OmegaConf's "Value 'abc' of type 'str' could not be converted to Integer" -> "'abc' is not an integer"."""
    if m := re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", what):
        kind = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}.get(m.group(2), m.group(2))
        return f"{m.group(1)!r} is not {kind}"
    if m := re.match(r"Value '(.*)' is not a valid bool", what):
        return f"{m.group(1)!r} is not true or false"
    if m := re.match(r"Invalid type assigned: (\w+) is not a subclass of (\w+)", what):
        return (
            f"a {m.group(1)} was given where a section ({m.group(2)}) belongs; "
            "set its keys instead (e.g. key.field=value)"
        )
    return what


def _near(word: str, choices, cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]}?" if close else ""


# ---------------------------------------------------------------- pydantic's validation errors in one line


UNKNOWN_KEY = ("extra_forbidden", "unexpected_keyword_argument")  # a key the model or a dataclass in it lacks


def validation_line(exc, schema: dict | None = None, root: str = "the input") -> str:
    """One line for a pydantic ValidationError: `<dotted.field.path>: <what is wrong>; allowed: <keys, values or
    range>` (read through ``exc.errors()``: pydantic is not imported here). The allowed keys, values and ranges come
    from `schema`, the model's JSON Schema (from the error's own context without it). The first error is shown,
    an unknown key before any other (a typo'd key explains a missing one). A union's branch, named in parentheses
    in the loc (``Tag("(mapping)")``), and pydantic's ``[key]`` marker are left out of the path; `root` names an
    error of the whole input."""
    errs = exc.errors(include_url=False)
    err = next((e for e in errs if e["type"] in UNKNOWN_KEY), errs[0])
    loc = [p for p in err["loc"] if not (isinstance(p, str) and (p == "[key]" or p[:1] + p[-1:] == "()"))]
    schema = schema or {}
    words = _VALIDATION_WORDS.get(err["type"], _message)
    return " ".join(words(_dotted(loc) or root, loc, err, _schema_node(schema, loc), schema).split())


def _dotted(loc: list) -> str:
    parts = [f"[{p}]" if isinstance(p, int) else "." + (p if len(p) <= SHOWN_CHARS else shown(p)) for p in loc]
    return "".join(parts).lstrip(".")


def _branches(node: dict, schema: dict) -> list[dict]:
    """`node` ($ref resolved) and, recursively, every branch of its anyOf / oneOf / allOf."""
    while "$ref" in node:
        node = schema.get("$defs", {}).get(node["$ref"].rsplit("/", 1)[-1], {})
    out = [node]
    for sub in node.get("anyOf", []) + node.get("oneOf", []) + node.get("allOf", []):
        out += _branches(sub, schema)
    return out


def _child(node: dict, part) -> dict | None:
    if isinstance(part, int):
        prefix = node.get("prefixItems", [])
        return prefix[part] if part < len(prefix) else node.get("items")
    if part in node.get("properties", {}):
        return node["properties"][part]
    extra = node.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _schema_node(schema: dict, loc: list) -> list[dict]:
    """The branches of the schema node at `loc` ([] where the schema does not say)."""
    node = schema
    for part in loc:
        node = next((c for c in (_child(b, part) for b in _branches(node, schema)) if c is not None), None)
        if node is None:
            return []
    return _branches(node, schema)


def _got(err: dict) -> str:
    return f"; got {shown(err['input'])}" if "input" in err else ""


def _unknown_field(path, loc, err, nodes, schema) -> str:
    allowed = [k for n in _schema_node(schema, loc[:-1]) for k in n.get("properties", {})]
    where = _dotted(loc[:-1]) + "." if len(loc) > 1 else ""
    near = difflib.get_close_matches(str(loc[-1])[:200], allowed, n=1)
    return (
        f"unknown key {path}"
        + (f" (did you mean {where}{near[0]}?)" if near else "")
        + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    )


def _not_allowed(path, loc, err, nodes, schema) -> str:
    values = [str(v) for n in nodes for v in n.get("enum", [n["const"]] if "const" in n else [])]
    values = ", ".join(values) or err.get("ctx", {}).get("expected")  # no schema: pydantic's "'a' or 'b'"
    about = " ".join(n["description"] for n in nodes[:1] if "description" in n)
    allowed = f"allowed values: {values}" if values else f"allowed: {about or err['msg']}"
    return f"{path}={shown(err['input'])} is not allowed; {allowed}"


_BOUNDS = (  # JSON Schema's keyword, pydantic's ctx key, the sign, the interval's bracket
    ("minimum", "ge", ">=", "["),
    ("exclusiveMinimum", "gt", ">", "("),
    ("maximum", "le", "<=", "]"),
    ("exclusiveMaximum", "lt", "<", ")"),
)


def _num(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _must_be_number(path, loc, err, nodes, schema) -> str:
    """'<path> must be ' 'an integer >= 1', 'a number > 0 or null', 'in (0, 1)', 'an integer in [0, 4294967295]'."""
    num = next((n for n in nodes if n.get("type") in ("integer", "number")), None)
    if num is None:  # no schema: the error's own bound
        whole = err["type"].startswith("int") or type(err.get("input")) is int
        ctx = err.get("ctx", {})
        num = {"type": "integer" if whole else "number"} | {k: ctx[c] for k, c, *_ in _BOUNDS if c in ctx}
    finite = "finite " if err["type"] == "finite_number" else ""
    kind = "an integer" if num["type"] == "integer" else f"a {finite}number"
    low = [(num[k], sign, br) for k, _, sign, br in _BOUNDS[:2] if k in num]
    high = [(num[k], sign, br) for k, _, sign, br in _BOUNDS[2:] if k in num]
    if low and high:
        what = f"{kind if kind == 'an integer' else ''} in {low[0][2]}{_num(low[0][0])}, {_num(high[0][0])}{high[0][2]}"
    else:
        what = kind + "".join(f" {sign} {_num(value)}" for value, sign, _ in low + high)
    null = " or null" if any(n.get("type") == "null" for n in nodes) else ""
    return f"{path} must be {what.strip()}{null}{_got(err)}"


def _length(path, loc, err, nodes, schema) -> str:
    shape = "object" if isinstance(err.get("input"), dict) else "array"
    node = next((n for n in nodes if n.get("type") == shape), {})
    what = "mapping" if node.get("type") == "object" else "list"
    low, high = node.get("minItems", err.get("ctx", {}).get("min_length")), node.get("maxItems")
    size = f"a list of {low}" if low == high else f"a non-empty {what}" if low == 1 else f"a {what} of at least {low}"
    return f"{path} must be {size}{_got(err) if err['input'] not in ([], {}) else ''}"


def _shape(kind: str):
    def words(path, loc, err, nodes, schema) -> str:
        value = err.get("input")
        return f"{path} must be {kind}; got {type(value).__name__}: {shown(value, 60)}"

    return words


READS_ON = ("must ", "lists ", "needs ")  # reads on from the field path ("seeds lists a value twice"), no colon


def _message(path, loc, err, nodes, schema) -> str:
    """The error's own message: "<path> must ..." or "<path>: <message>". A validator's own ValueError is shown
    without the path where it names the field first, and without the input; pydantic's (or a custom type's) with."""
    raised = err["type"] in ("value_error", "assertion_error")
    text = str(err.get("ctx", {}).get("error", err["msg"])) if raised else err["msg"]
    if raised and (not loc or text.startswith(path)):
        return text
    return f"{path}{' ' if text.startswith(READS_ON) else ': '}{text}" + ("" if raised else _got(err))


# How each kind of pydantic error is worded (pydantic's error types); any other: its own message.
# unexpected_keyword_argument: a key a dataclass field (the core's KLConfig, ...) does not have.
_VALIDATION_WORDS = {
    **dict.fromkeys(UNKNOWN_KEY, _unknown_field),
    "missing": lambda path, *_: f"`{path}` is required",
    **dict.fromkeys(
        "literal_error enum string_pattern_mismatch string_too_long string_too_short".split(), _not_allowed
    ),
    **dict.fromkeys(("too_short", "too_long"), _length),
    **dict.fromkeys(("model_type", "model_attributes_type", "dict_type", "dataclass_type"), _shape("a mapping")),
    **dict.fromkeys(("list_type", "tuple_type"), _shape("a list")),
    "string_type": _shape("a string"),
    "bool_type": _shape("true or false"),
    **dict.fromkeys(
        "int_type int_from_float int_parsing float_type float_parsing finite_number greater_than greater_than_equal"
        " less_than less_than_equal".split(),
        _must_be_number,
    ),
}
