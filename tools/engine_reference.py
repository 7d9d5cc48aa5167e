"""Generate the reference parts of docs/engine.md from the code, so the page cannot drift.

    python tools/engine_reference.py          # rewrite the generated blocks of docs/engine.md
    python tools/engine_reference.py --check  # exit 1 if they are out of date (the test does this)

Two blocks are generated, each between ``<!-- generated:NAME -->`` and ``<!-- end:NAME -->``:

- ``config``: every config section and key: its type and default (from the pydantic models in
  `tachyon.config`), and whether tachyon implements it, maps it, accepts and ignores it (with the
  reason, `tachyon.config.keys.ACCEPTED_IGNORED_KEYS`) or refuses it (the feature and the value
  that turns it off, `UNSUPPORTED_KEYS` / `OFF_VALUES`); the optimizer and scheduler types with
  their parameters.
- ``engine``: every public method and attribute of `tachyon.Engine` with the first line of its
  docstring, and DeepSpeed's engine names it does not provide with the reason and the
  alternative (`tachyon.engine.compat_missing.NOT_PROVIDED`).
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "engine.md"

MAPPED = {
    "bfloat16": "DeepSpeed's older name of the `bf16` section: read as `bf16`",
    "optimizer.params.adam_w_mode": 'with type "AdamW" always true (a false is accepted and reported, as DeepSpeed '
                                    "ignores it); with \"Adam\" it picks decoupled (true) or L2 (false) weight decay",
    "data_types.grad_accum_dtype": "fp32 or the model dtype: used; another dtype under ZeRO 1/2: accepted, reported, "
                                   "accumulation in the model dtype (DeepSpeed's ZeRO optimizer does the same); "
                                   "without ZeRO: refused (as DeepSpeed)",
    "tensor_parallel.autotp_size": "DeepSpeed's AutoTP size: mapped onto tachyon's tensor parallelism (`tp_size`)",
    "zero_optimization.stage3_prefetch_bucket_size": "at stage 3: non-zero makes each sharded block's forward prefetch "
                                                     "the next block's all-gather (FSDP2), 0 turns it off; the size "
                                                     "itself is not used (FSDP2 gathers whole blocks)",
    "zero_optimization.prefetch_bucket_size": "DeepSpeed's other spelling of stage3_prefetch_bucket_size: read as it",
}
STATUS = {
    "zero_optimization.stage": "implemented: 0, 1, 2 and 3 (stage 3 on torch's FSDP2: docs/zero.md)",
    "zero_optimization.shard_module_classes": "implemented (tachyon's): more module classes stage 3 shards as units",
    "pipeline.activation_checkpoint_interval": "implemented: a positive value replaces the PipelineModule's own "
                                               "interval (DeepSpeed's PipelineEngine)",
    "pipeline.use_reentrant": "implemented: false sets the PipelineModule's activation_checkpoint_func to "
                              "checkpointing.non_reentrant_checkpoint; true / unset keeps the module's (tachyon's "
                              "checkpointing is non-reentrant either way)",
    **{f"zero_optimization.{key}": "implemented at stages 1 and 2; at stage 3 accepted, reported as ignored (FSDP2 "
       "works per block)" for key in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                                      "contiguous_gradients", "reduce_scatter", "round_robin_gradients")},
}


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right after a field) of ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass.__module__.startswith("pydantic"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(annotation: typing.Any) -> str:
    """A short, readable type: ``int``, ``float or null``, ``"log" or "linear"``, ``list of float``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type_name(a) for a in args))
    if origin is typing.Literal:
        return " or ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (list, tuple):
        return f"{origin.__name__} of {_type_name(args[0])}" if args else origin.__name__
    if origin is dict:
        return "object"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return "section" if issubclass(annotation, BaseModel) else annotation.__name__
    return str(annotation).replace("typing.", "")


def _default(info: typing.Any) -> str:
    if info.default is PydanticUndefined:
        return "(section)" if info.default_factory is not None else "required"
    value = info.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def _section_model(annotation: typing.Any) -> type[BaseModel] | None:
    candidates = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        candidates = list(typing.get_args(annotation))
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _status(path: str) -> str:
    from tachyon.config import keys

    pattern = keys._lookup_unsupported(path)
    if path in STATUS:
        return STATUS[path]
    if path in MAPPED:
        return "mapped: " + MAPPED[path]
    if pattern is not None:
        _, off = keys.OFF_VALUES.get(pattern, (None, None))
        what = keys.UNSUPPORTED_KEYS[pattern]
        return f"implemented; {'other values than ' + off if off else 'enabling it'} refused ({what})"
    return "implemented"


def _rows(model: type[BaseModel], prefix: str, out: list[str], sections: list[tuple[str, type[BaseModel]]]) -> None:
    docs = _field_docs(model)
    for name, info in model.model_fields.items():
        key = info.alias or name
        path = f"{prefix}.{key}" if prefix else key
        section = _section_model(info.annotation)
        if section is not None and section.__name__ not in ("OptimizerConfig", "SchedulerConfig"):
            sections.append((path, section))
            continue
        note = docs.get(name, "")
        status = _status(path)
        out.append(f"| `{path}` | {_type_name(info.annotation)} | {_default(info)} | {status}"
                   f"{'. ' + note if note else ''} |")


def _extra_keys(prefix: str, fields: set[str]) -> list[str]:
    """Refused and ignored keys that live directly under ``prefix`` and are not model fields."""
    from tachyon.config import keys

    rows = []
    for path, what in keys.UNSUPPORTED_KEYS.items():
        parent, _, key = path.rpartition(".")
        if parent == prefix and key not in fields:
            _, off = keys.OFF_VALUES.get(path, (None, None))
            accepted = f"accepted (ignored) as {off}, otherwise " if off else ""
            rows.append(f"| `{path}` | | | {accepted}refused: {what} |")
    for path, reason in keys.ACCEPTED_IGNORED_KEYS.items():
        parent, _, key = path.rpartition(".")
        if parent == prefix and key not in fields:
            rows.append(f"| `{path}` | any | | accepted, ignored: {reason} |")
    return rows


HEADER = "| key | type | default | status |\n| --- | --- | --- | --- |"


def config_block() -> str:
    from tachyon.config import TachyonConfig
    from tachyon.config.optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS, UNSUPPORTED_OPTIMIZERS

    out = ["### Top level", "", HEADER]
    sections: list[tuple[str, type[BaseModel]]] = []
    _rows(TachyonConfig, "", out, sections)
    out += _extra_keys("", set(TachyonConfig.model_fields))
    out.append(f"| `bfloat16` | section | | {_status('bfloat16')} |")
    for path, model in sections:
        out += ["", f"### `{path}`", "", HEADER]
        nested: list[tuple[str, type[BaseModel]]] = []
        _rows(model, path, out, nested)
        fields = {info.alias or name for name, info in model.model_fields.items()}
        out += _extra_keys(path, fields)
        for sub, submodel in nested:
            _rows(submodel, sub, out, [])
            out += _extra_keys(sub, {info.alias or name for name, info in submodel.model_fields.items()})
    for title, table in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        out += ["", f"### `{title}`: `type` and `params`", "",
                "| type | params (default) |", "| --- | --- |"]
        for name, model in table.items():
            params = ", ".join(f"`{key}` ({_default(info)})" for key, info in model.model_fields.items())
            out.append(f"| {name} | {params} |")
        if title == "optimizer":
            out.append(f"| refused | {', '.join(f'{n} ({w})' for n, w in UNSUPPORTED_OPTIMIZERS.items())} |")
        extra = _extra_keys(title, {"type", "params"})
        if extra:
            out += ["", HEADER, *extra]
    return "\n".join(out)


def _first_line(obj: typing.Any) -> str:
    """The first paragraph of the docstring; for an undocumented one-line config getter, the key it reads."""
    doc = inspect.getdoc(obj) if getattr(obj, "__doc__", None) else ""
    if not doc:
        name = getattr(obj, "__name__", "")
        if name == "_off":
            return "False: DeepSpeed's getter of a feature tachyon does not have (its config keys are refused unless off)"
        if name == "_none":
            return "None: DeepSpeed's getter of a feature tachyon does not have"
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            return ""
        read = re.findall(r"return (?:[a-z]+\()?self\.(config\.[\w.]+|[a-z_]+\.[\w.]+|[a-z_]+)", source)
        return f"returns `engine.{read[0]}`" if read else ""
    first = doc.split("\n\n")[0]
    return " ".join(first.split()).replace("|", "\\|")


def engine_block() -> str:
    from tachyon.engine import Engine
    from tachyon.engine.compat_missing import NOT_PROVIDED

    out = ["| attribute or method | what it is |", "| --- | --- |"]
    names = sorted({n for klass in Engine.__mro__ if klass.__module__.startswith("tachyon")
                    for n in vars(klass) if not n.startswith("_")})
    for name in names:
        member = inspect.getattr_static(Engine, name)
        target = member.fget if isinstance(member, property) else member
        target = getattr(target, "__func__", target)
        kind = "" if isinstance(member, property) or not callable(target) else "()"
        text = _first_line(target) if callable(target) else f"`{member!r}`"
        out.append(f"| `{name}{kind}` | {text} |")
    out += ["", "DeepSpeed engine names tachyon's engine does not provide (using one raises "
            "`EngineAttributeError`, an AttributeError and NotImplementedError, with this text):", "",
            "| names | why | use instead |", "| --- | --- | --- |"]
    by_reason: dict[tuple[str, str], list[str]] = {}
    for name, reason in NOT_PROVIDED.items():
        by_reason.setdefault(reason, []).append(name)
    for (why, instead), group in by_reason.items():
        out.append(f"| {', '.join(f'`{n}`' for n in sorted(group))} | {why} | {instead} |")
    return "\n".join(out)


BLOCKS = {"config": config_block, "engine": engine_block}


def render(text: str) -> str:
    """``text`` with every generated block replaced by its current content."""
    for name, build in BLOCKS.items():
        start, end = f"<!-- generated:{name} -->", f"<!-- end:{name} -->"
        if start not in text or end not in text:
            raise ValueError(f"docs/engine.md lacks the markers {start} ... {end}")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{build()}\n{end}{tail}"
    return text


def main(argv: list[str]) -> int:
    current = DOC.read_text(encoding="utf-8")
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print("docs/engine.md is out of date: run python tools/engine_reference.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
