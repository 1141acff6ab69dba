"""Config -> core objects (compose, validate, task, model). The only place Hydra/OmegaConf meets ema_pg_core
(docs/architecture.md)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from ema_pg_core.config import eval_problems, probe_prompts
from ema_pg_core.kl import get_estimator
from ema_pg_core.local.trainer import LocalConfig
from ema_pg_core.overrides import hydra_value
from experiments import progress, tasks, user_yaml
from experiments.backends.verl.launch import to_verl
from experiments.errors import UserError, _is_hydra, hydra_message, shown
from experiments.ops.retrieval.service import HTTPRetriever, check_answers
from experiments.schema import RunConfig
from experiments.tasks import TaskAdapter, ToolEnvAdapter, conf_dirs, get_task

CONF_DIR = Path(__file__).parent / "conf"  # the package experiments.conf
SMOKE = {  # smoke=true: tiny sizes, 2 iterations; a key given on the command line keeps its value
    "trainer.iterations": 2,
    "trainer.eval_every": 1,
    "trainer.eval_size": 4,
    "trainer.eval_n": 2,
    "trainer.save_every": 1,
    "rollout.prompts_per_iter": 2,
    "rollout.group_size": 2,
    "rollout.max_new_tokens": 12,
    "rollout.max_turns": 1,
    "task.train_size": 40,
    "task.test_size": 8,
    "model.pretrain_steps": 2,
}
RESUME_VALUES = (False, True, "auto", "force")  # what each means: experiments.run.resume_mode
NAME_MAX_BYTES, PATH_MAX_BYTES = 255, 4095  # longest path component and path file systems take (Linux)


def presets(tasks_dirs: bool = True) -> list[str]:
    """Names of the experiment presets (the config group `experiment`; `tasks_dirs` as in `group_options`)."""
    return group_options(tasks_dirs)["experiment"]


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose experiments/conf/config.yaml with Hydra overrides (``key=value``, ``experiment=...``)."""
    store = ConfigStore.instance()  # the schema, and task=<name> for each task without a conf/task/<name>.yaml
    store.store(name="run_schema", node=RunConfig)
    for name in sorted(set(tasks.TASKS) - {p.stem for p in (CONF_DIR / "task").glob("*.yaml")}):
        store.store(group="task", name=name, node={"name": name})
    overrides = list(overrides)
    check_depth(overrides)
    exp = [o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")]
    if exp and exp[-1] not in presets():
        raise ValueError(f"unknown experiment preset {exp[-1]!r}; allowed: {', '.join(presets())}")
    dirs = conf_dirs()  # the tasks' config directories, on Hydra's search path
    search = ["hydra.searchpath=[" + ",".join(f"file://{d}" for d in dirs) + "]"] if dirs else []
    GlobalHydra.instance().clear()
    try:
        with hydra.initialize_config_module(config_module="experiments.conf", version_base="1.3"):
            cfg = hydra.compose(config_name="config", overrides=overrides + search)
        OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.to_container(cfg))  # +key=... the schema lacks
    except Exception as e:  # noqa: BLE001  Hydra/OmegaConf errors -> one line naming the key
        if not _is_hydra(e):
            raise
        raise UserError(unquoted_value(overrides) or hydra_message(e, schema_keys())) from e
    if cfg.smoke:  # smoke sizes, except where the command line sets the key itself
        given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
        for key, value in SMOKE.items():
            if key not in given:
                OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def check_depth(overrides: list[str]) -> None:
    """Refuse the first override nested deeper than user_yaml.MAX_DEPTH (its dotted key's levels, then the lists,
    mappings, calls and interpolations of its value): Hydra's override parser and OmegaConf recurse per level, and
    deeper input would end in a RecursionError, not a message."""
    for override in overrides:
        key, _, value = override.partition("=")
        keys, nest, deepest, quote, quoted_at = key.count(".") + 1, 0, 0, None, 0
        for i, c in enumerate(value):
            if quote is None:
                if c in "'\"":
                    quote, quoted_at = c, nest
                nest += (c in "[{(") - (c in "]})")
            elif c == quote and value[i - 1 : i] != "\\":
                quote = None
            elif value.startswith("${", i):  # inside quotes only an interpolation nests: '${a:${b:c}}'
                nest += 1
            elif c == "}" and nest > quoted_at:
                nest -= 1
            deepest = max(deepest, nest)
        if keys + deepest > user_yaml.MAX_DEPTH:
            raise UserError(f"override {shown(override)}: {user_yaml.too_deep()}")


def unquoted_value(overrides: list[str]) -> str | None:
    """For the first override Hydra cannot parse but would with its value quoted (spaces with brackets, a leading
    ~, a quote, ...: Hydra's lexer), one line saying how to quote it; None when quoting would not help."""
    for override in overrides:
        key, eq, value = override.partition("=")
        quote = "'" if '"' in value else '"'
        quoted = f"{key}={quote}{value}{quote}"
        if eq and quote not in value and _parsed(override) is None and _parsed(quoted) is not None:
            return (
                f"cannot parse the override {override!r}: quote its value for Hydra, e.g. {quoted} "
                f"(in a shell: {shlex.quote(quoted)})"
            )
    return None


def path_override(key: str, path: str) -> str:
    """key=<path>, quoted for Hydra only where Hydra would not read the path back as it is."""
    parsed = _parsed(f"{key}={path}")
    plain = parsed is not None and parsed.value() == path
    return f"{key}={path}" if plain else f"{key}={hydra_value(path, quote=chr(34))}"


def _parsed(override: str):
    """Hydra's reading of `override` (an Override), or None where its lexer or parser refuses it."""
    try:
        return OverridesParser.create().parse_override(override)
    except Exception:  # noqa: BLE001  Hydra's lexer and parser errors
        return None


def schema_keys() -> list[str]:
    """Every dotted key of the run schema (e.g. ``trainer.iterations``): what an override may set."""

    def leaves(node, prefix: str) -> list[str]:
        out = []
        for key in node:
            child = node._get_node(key)
            if isinstance(child, DictConfig) and child._metadata.object_type not in (dict, None):
                out += leaves(child, f"{prefix}{key}.")
            else:
                out.append(f"{prefix}{key}")
        return out

    return leaves(OmegaConf.structured(RunConfig), "")


def group_options(tasks_dirs: bool = True) -> dict[str, list[str]]:
    """Config groups and their options, e.g. {"task": ["math", ...]}: experiments/conf/<group>/*.yaml and, with
    `tasks_dirs`, the same in the config directories of registered tasks (their CONF_DIR); the task options are
    every registered task (`compose` stores those without a YAML file)."""
    groups: dict[str, set[str]] = {"task": set(tasks.TASKS)}
    for root in [CONF_DIR] + ([Path(d) for d in conf_dirs()] if tasks_dirs else []):
        for d in root.iterdir():
            if d.is_dir() and not d.name.startswith(("_", "verl")):
                groups.setdefault(d.name, set()).update(p.stem for p in d.glob("*.yaml"))
    return {name: sorted(options) for name, options in sorted(groups.items())}


def validate(cfg: DictConfig) -> LocalConfig:
    """Fail before any work: unknown task, bad model path, invalid algorithm settings, backend."""
    if cfg.task.name not in tasks.TASKS:
        raise ValueError(f"task.name={cfg.task.name!r} is not a known task; allowed: {', '.join(sorted(tasks.TASKS))}")
    if cfg.backend.name not in ("local", "verl"):
        raise ValueError(f"backend.name={cfg.backend.name!r} is not allowed; allowed values: local, verl")
    path = cfg.model.path
    if cfg.backend.name == "local" and path is not None and not Path(os.path.expanduser(path)).is_dir():
        raise ValueError(f"model.path={cfg.model.path!r} does not exist (expected a local HF model directory)")
    if cfg.resume not in RESUME_VALUES:
        raise ValueError(f"resume={cfg.resume!r} is not allowed; allowed values: false, true, auto, force")
    for key in ("run_dir", "out_root"):
        check_path(key, cfg[key])
    if cfg.model.name == "hf" and cfg.model.path is None:
        raise ValueError("model=hf needs model.path (a local Hugging Face model directory), e.g. model.path=~/models/x")
    for key, allowed in (("name", ("wandb", "none")), ("mode", ("offline", "online", "disabled"))):
        if cfg.logger[key] not in allowed:
            raise ValueError(f"logger.{key}={cfg.logger[key]!r} is not allowed; allowed values: {', '.join(allowed)}")
    OmegaConf.to_object(cfg.task), OmegaConf.to_object(cfg.model)  # each section validates itself
    sections = {name: OmegaConf.to_object(cfg[name]) for name in ("algo", "rollout", "optim", "trainer")}
    local = LocalConfig(**sections, seed=int(cfg.seed))  # the core trainer's config: each dataclass validates itself
    if cfg.backend.name == "local":  # eval and probe prompts come from the held-out split (verl: its val files)
        eval_problems(local.trainer, int(cfg.task.test_size)), probe_prompts(local.trainer, int(cfg.task.test_size))
    OmegaConf.to_object(cfg.health)  # each rule's section validates itself (health.<rule>.<field> in the error)
    if cfg.health.kl_spike.factor is not None and cfg.algo.kl.coef == 0:  # a rule that could never fire
        raise ValueError(
            f"health.kl_spike.factor={cfg.health.kl_spike.factor} watches kl/value, which a run with algo.kl.coef=0 "
            "does not compute; set health.kl_spike.factor=null or a KL coefficient > 0"
        )
    if cfg.backend.name == "verl":  # verl reads model.path as an HF id or a directory on its workers
        to_verl(OmegaConf.to_container(cfg, resolve=True))  # e.g. batch sizes verl cannot split
    return local


def check_path(key: str, path) -> None:
    """Refuse a path no file system takes (a component over NAME_MAX_BYTES, the whole over PATH_MAX_BYTES)."""
    if path is None:
        return
    full = os.path.abspath(os.path.expanduser(str(path)))
    long = [part for part in Path(full).parts if len(os.fsencode(part)) > NAME_MAX_BYTES]
    if long:
        raise ValueError(
            f"{key}: the path component {long[0][:40]!r}... is {len(os.fsencode(long[0]))} bytes long; "
            f"file systems allow at most {NAME_MAX_BYTES} bytes per directory or file name"
        )
    if len(os.fsencode(full)) > PATH_MAX_BYTES:
        raise ValueError(f"{key}: the path is {len(os.fsencode(full))} bytes long; at most {PATH_MAX_BYTES} allowed")


RETRIEVER_TIMEOUT_S = 4.0  # seconds to connect to task.retriever_url, then as long for its answer


def check_retriever(cfg: DictConfig) -> None:
    """A tool task's task.retriever_url must answer (any HTTP response but a 401: Search-R1-compatible servers may
    have no /health) before any work, or the run is refused naming the URL (within 2 x RETRIEVER_TIMEOUT_S seconds)."""
    url = cfg.task.retriever_url
    if not url or not get_task(cfg.task.name).STOP_STRINGS:
        return
    import httpx

    try:
        check_answers(str(url), timeout=RETRIEVER_TIMEOUT_S)  # with this process's token: a 401 is not an answer
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        said = (str(e).strip().splitlines() or ["no answer"])[0]
        raise ValueError(
            f"task.retriever_url={url} is not reachable ({type(e).__name__}: {said}); start it with "
            f"`emapg retriever serve --task {cfg.task.name} --port <port>`, or set task.retriever_url=null "
            "(in-process BM25)"
        ) from None


# ------------------------------------------------------------------------------ tasks
def task(cfg: DictConfig):
    """The task the trainer consumes: its seeded train/test splits and, for a tool task, its environment."""
    mod = get_task(cfg.task.name)
    knobs = OmegaConf.to_container(cfg.task.knobs, resolve=True)
    train = mod.load("train", n=int(cfg.task.train_size), seed=int(cfg.task.data_seed), **knobs)
    test = mod.load("test", n=int(cfg.task.test_size), seed=int(cfg.task.data_seed), **knobs)
    env = None
    if mod.STOP_STRINGS:
        url = cfg.task.retriever_url
        env = ToolEnvAdapter(mod, HTTPRetriever(url) if url else mod.make_env(**knobs))
    return TaskAdapter(cfg.task.name, mod, train, test, env)


# ------------------------------------------------------------------------------ models
def model(cfg: DictConfig):
    """(policy, tokenizer) in cfg.trainer.dtype. The tiny model is warm-started once and cached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cfg.model.path
    if path is None:
        from experiments.pretrain import pretrain  # loads transformers

        path = pretrain(
            cfg.task.name,
            model_cfg={key: int(cfg.model[key]) for key in ("hidden", "layers", "heads")},
            steps=None if cfg.model.pretrain_steps is None else int(cfg.model.pretrain_steps),
            cache_dir=os.path.expanduser(cfg.model.cache_dir),
            knobs=OmegaConf.to_container(cfg.task.knobs, resolve=True),
            progress=progress.enabled(),
        )
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.trainer.dtype)), tok


def check_k(cfg: DictConfig) -> None:
    """A Top-k head larger than the model's vocabulary is refused before any work (read without weights).
    Not part of `validate`: a sweep's base may set a k that only its non-Top-k trials use."""
    if get_estimator(cfg.algo.kl.type).needs != "topk":
        return
    vocab = vocab_size(cfg)
    if vocab is not None and int(cfg.algo.kl.k) > vocab:
        model = "the tiny model" if cfg.model.path is None else f"model.path={cfg.model.path}"
        raise ValueError(
            f"algo.kl.k={cfg.algo.kl.k} exceeds the vocabulary of {model} ({vocab} tokens); "
            f"algo.kl.type={cfg.algo.kl.type} needs 0 <= algo.kl.k <= {vocab}"
        )


def vocab_size(cfg: DictConfig) -> int | None:
    """Rows of the output embedding of cfg's model, read without loading weights or training: the tiny model's
    character tokenizer (ema_pg_core.local.tiny, the same for every task), or model.path's config.json; None when
    model.path is an HF id with no local copy (verl downloads it on its workers)."""
    path = cfg.model.path
    if path is None:
        from ema_pg_core.local.tiny import build_tokenizer  # loads transformers

        return len(build_tokenizer())
    from transformers import AutoConfig

    local = os.path.expanduser(str(path))
    try:
        config = AutoConfig.from_pretrained(local, local_files_only=True)
    except (OSError, ValueError) as e:
        if Path(local).is_dir():
            raise ValueError(" ".join(f"model.path={path!r} has no readable config.json: {e}".split())) from None
        return None
    return int(config.get_text_config().vocab_size)
