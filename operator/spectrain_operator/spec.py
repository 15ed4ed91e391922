"""Offline understanding of a SpecTrainJob: load, default and validate it exactly as the API server
would (the CRD's own structural schema, defaults and CEL rule strings, evaluated with celpy), plus
the semantic checks the schema cannot express (model layers divisible by the pipeline degree, known
presets): `spectrain_api.rules.check_spec`, the rules the workloads enforce at start.
Every error is one line that starts with the field path and says how to fix it.

Used by `spectrain validate`/`render`, the local backend and the operator's reconcile (a 1.20 API
server has no CEL, so the operator re-checks the rules and reports SpecInvalid).
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from spectrain_api import volumes
from spectrain_api.names import API_VERSION, KIND

CRD_FILE = "spectrain.io_spectrainjobs.yaml"

Obj = dict[str, Any]


class SpecError(ValueError):
    """A manifest that cannot run; `errors` holds one line per problem, each naming the field."""

    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


@functools.cache
def crd() -> Obj:
    """The CRD this package ships (a byte copy of crds/, kept identical by scripts/gen.py)."""
    repo_copy = Path(__file__).resolve().parents[2] / "crds" / CRD_FILE
    if repo_copy.is_file():
        text = repo_copy.read_text()
    else:
        text = importlib.resources.files("spectrain_operator").joinpath("data", CRD_FILE).read_text()
    return dict(yaml.safe_load(text))


def schema() -> Obj:
    return dict(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def load_manifests(path: str | Path) -> list[Obj]:
    """Every non-empty YAML document of a file ('-' is not supported: pass a path)."""
    text = Path(path).read_text()
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    return docs


# ---------------------------------------------------------------- defaulting (API-server algorithm)

def _prune_nulls(value: Any, node: Obj) -> Any:
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties") if isinstance(node.get("additionalProperties"), dict) else None
        out = {}
        for key, sub in value.items():
            child = props.get(key, extra)
            if sub is None and not (child or {}).get("nullable") and child is not None:
                continue
            out[key] = _prune_nulls(sub, child) if child is not None else sub
        return out
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_prune_nulls(v, node["items"]) for v in value]
    return value


def _default(value: Any, node: Obj) -> Any:
    if isinstance(value, dict):
        props = node.get("properties") or {}
        for key, child in props.items():
            if key not in value and "default" in child:
                value[key] = copy.deepcopy(child["default"])
        for key, sub in value.items():
            child = props.get(key)
            if child is None and isinstance(node.get("additionalProperties"), dict):
                child = node["additionalProperties"]
            if child is not None:
                value[key] = _default(sub, child)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_default(v, node["items"]) for v in value]
    return value


def apply_defaults(manifest: Obj) -> Obj:
    """A deep copy with nulls of non-nullable fields pruned and the CRD's defaults applied."""
    root = schema()
    obj = _prune_nulls(copy.deepcopy(manifest), root)
    if isinstance(obj.get("spec"), dict):
        obj["spec"] = _default(obj["spec"], root["properties"]["spec"])
    return obj


# ---------------------------------------------------------------- structural schema validation

_TYPES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
          "object": "a mapping", "array": "a list"}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_ok(value: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "object": dict, "array": list}[t])


def _schema_errors(value: Any, node: Obj, path: str, out: list[str]) -> None:
    if value is None:
        if not node.get("nullable"):
            out.append(f"{path}: must not be null")
        return
    if node.get("x-kubernetes-int-or-string"):
        if not (isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))):
            out.append(f"{path}: must be an integer or a quantity string like 8Gi (got {_show(value)})")
        elif isinstance(value, str) and "pattern" in node and not re.search(node["pattern"], value):
            out.append(f"{path}: {_show(value)} is not a valid quantity (examples: 256Mi, 8Gi, 1000)")
        return
    t = node.get("type")
    if t and not _type_ok(value, t):
        out.append(f"{path}: must be {_TYPES[t]} (got {type(value).__name__} {_show(value)})")
        return
    if "enum" in node and value not in node["enum"]:
        allowed = ", ".join(str(v) for v in node["enum"] if v != "")
        out.append(f"{path}: {_show(value)} is not one of: {allowed}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in node:
            if node.get("exclusiveMinimum") and value <= node["minimum"]:
                out.append(f"{path}: must be > {node['minimum']} (got {_show(value)})")
            elif value < node["minimum"]:
                out.append(f"{path}: must be >= {node['minimum']} (got {_show(value)})")
        if "maximum" in node and value > node["maximum"]:
            out.append(f"{path}: must be <= {node['maximum']} (got {_show(value)})")
    if isinstance(value, str):
        if len(value) < node.get("minLength", 0):
            out.append(f"{path}: must not be empty" if node["minLength"] == 1
                       else f"{path}: must be at least {node['minLength']} characters")
        if "maxLength" in node and len(value) > node["maxLength"]:
            out.append(f"{path}: must be at most {node['maxLength']} characters (got {len(value)})")
        if "pattern" in node and not re.search(node["pattern"], value):
            out.append(f"{path}: {_show(value)} is not of the required form: {node.get('description', node['pattern'])}")
    if isinstance(value, list):
        if len(value) < node.get("minItems", 0):
            out.append(f"{path}: must have at least {node['minItems']} item(s)")
        if "maxItems" in node and len(value) > node["maxItems"]:
            out.append(f"{path}: must have at most {node['maxItems']} items (got {len(value)})")
        if node.get("x-kubernetes-list-type") == "set":
            seen: list[Any] = []
            for v in value:
                if v in seen:
                    out.append(f"{path}: duplicate entry {_show(v)}")
                seen.append(v)
        items = node.get("items")
        if isinstance(items, dict):
            for idx, item in enumerate(value):
                _schema_errors(item, items, f"{path}[{idx}]", out)
    if isinstance(value, dict):
        props = node.get("properties") or {}
        for req in node.get("required", []):
            if req not in value:
                out.append(f"{path}.{req}: required")
        extra = node.get("additionalProperties")
        for key, sub in value.items():
            sub_path = f"{path}.{key}" if path else str(key)
            if key in props:
                _schema_errors(sub, props[key], sub_path, out)
            elif isinstance(extra, dict):
                _schema_errors(sub, extra, sub_path, out)
            elif not node.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{sub_path}: unknown field (the API server would drop it; check the spelling)")


def schema_errors(obj: Obj) -> list[str]:
    """Errors of a defaulted manifest against the CRD's structural schema (status is not checked)."""
    out: list[str] = []
    if obj.get("apiVersion") != API_VERSION:
        out.append(f"apiVersion: must be {API_VERSION} (got {_show(obj.get('apiVersion'))})")
    if obj.get("kind") != KIND:
        out.append(f"kind: must be {KIND} (got {_show(obj.get('kind'))})")
    root = schema()
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta.get("name"):
        out.append("metadata.name: required (a DNS-1035 label such as my-job)")
    else:
        _schema_errors(meta["name"], root["properties"]["metadata"]["properties"]["name"], "metadata.name", out)
        if not isinstance(meta.get("namespace", ""), str):
            out.append("metadata.namespace: must be a string")
    if "spec" not in obj:
        out.append("spec: required")
    else:
        _schema_errors(obj["spec"], root["properties"]["spec"], "spec", out)
    return out


# ---------------------------------------------------------------- CEL rules (the CRD's own strings)

@functools.cache
def _program(expr: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(expr))


_CEL_MEMO: dict[tuple[str, str], tuple[bool, str]] = {}
_CEL_MEMO_MAX = 8192


def _cel_eval(expr: str, value: Any, old: Any, transition: bool) -> tuple[bool, str]:
    """(rule holds, why it could not be evaluated). A rule is a pure function of self (and oldSelf):
    results are memoised by the JSON of its inputs, so the many identical sub-objects of similar
    jobs (a sweep; the defaulted drafter, runPolicy, ... sections) are evaluated once."""
    import celpy

    try:
        key = (expr, json.dumps([value, old], sort_keys=True, allow_nan=False, default=str))
    except (TypeError, ValueError):
        key = None
    if key is not None and key in _CEL_MEMO:
        return _CEL_MEMO[key]
    activation = {"self": celpy.json_to_cel(value)}
    if transition:
        activation["oldSelf"] = celpy.json_to_cel(old)
    try:
        result = (bool(_program(expr).evaluate(activation)), "")
    except Exception as exc:  # celpy raises its own error types for overflow, missing fields, ...
        result = (False, (str(exc).splitlines() or [type(exc).__name__])[0][:120])
    if key is not None:
        if len(_CEL_MEMO) >= _CEL_MEMO_MAX:
            _CEL_MEMO.clear()
        _CEL_MEMO[key] = result
    return result


def _cel_walk(value: Any, old: Any, node: Obj, path: str, out: list[str]) -> None:
    for r in node.get("x-kubernetes-validations", []):
        expr, message = r["rule"], r.get("message") or f"failed rule {r['rule']}"
        transition = "oldSelf" in expr
        if transition and old is None:
            continue
        ok, failure = _cel_eval(expr, value, old if transition else None, transition)
        if failure:
            message = f"{message} (rule {expr!r} could not be evaluated: {failure})"
        if not ok:
            out.append(message if message.startswith(path) and path else
                       (f"{path}: {message}" if path else message))
    if isinstance(value, dict):
        for key, child in (node.get("properties") or {}).items():
            if key in value and value[key] is not None:
                sub_old = old.get(key) if isinstance(old, dict) else None
                _cel_walk(value[key], sub_old, child, f"{path}.{key}" if path else key, out)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for idx, item in enumerate(value):
            _cel_walk(item, None, node["items"], f"{path}[{idx}]", out)


def cel_errors(obj: Obj, old: Obj | None = None) -> list[str]:
    """The CRD's x-kubernetes-validations on a defaulted, schema-valid manifest; transition rules
    (oldSelf) only when `old` (the stored object, defaulted) is given."""
    root = schema()
    out: list[str] = []
    view = {k: v for k, v in obj.items() if k in ("apiVersion", "kind", "metadata", "spec")}
    old_view = {k: v for k, v in old.items() if k in ("apiVersion", "kind", "metadata", "spec")} if old else None
    # Root rules see self.metadata.name only, as in the API server.
    for r in root.get("x-kubernetes-validations", []):
        sub = {"x-kubernetes-validations": [r]}
        _cel_walk({"metadata": {"name": (view.get("metadata") or {}).get("name", "")}}, None, sub, "", out)
    _cel_walk(view.get("spec"), (old_view or {}).get("spec"), root["properties"]["spec"], "spec", out)
    return out


# ---------------------------------------------------------------- semantic checks

def semantic_errors(obj: Obj) -> list[str]:
    """What passes schema and CEL but the workloads would still refuse at start: the same
    `check_spec` every workload entrypoint runs before training."""
    from spectrain_api.config import from_manifest
    from spectrain_api.errors import ConfigError
    from spectrain_api.rules import check_spec

    try:
        return check_spec(from_manifest(obj))
    except ConfigError as exc:
        return [str(exc)]


# ---------------------------------------------------------------- entry points

def validate(manifest: Obj, old: Obj | None = None, *, semantic: bool = True) -> list[str]:
    """All errors of a manifest, one line each, field path first; [] when it can run."""
    if not isinstance(manifest, dict):
        return [f"(document): must be a mapping with apiVersion, kind, metadata and spec "
                f"(got {type(manifest).__name__})"]
    obj = apply_defaults(manifest)
    errors = schema_errors(obj)
    if errors:
        return errors
    errors = cel_errors(obj, apply_defaults(old) if old else None)
    if errors or not semantic:
        return errors
    return semantic_errors(obj)


def defaulted(manifest: Obj) -> Obj:
    """The manifest with defaults applied; SpecError (all errors) when it is not valid."""
    errors = validate(manifest)
    if errors:
        raise SpecError(errors)
    obj = apply_defaults(manifest)
    obj.setdefault("metadata", {}).setdefault("namespace", "default")
    return obj


def claims(spec: Obj) -> list[tuple[str, str]]:
    """(field path, PVC name) of every claim the job mounts."""
    out = []
    if spec["target"]["checkpoint"].get("claimName", ""):
        out.append(("spec.target.checkpoint.claimName", spec["target"]["checkpoint"].get("claimName", "")))
    if spec["drafter"]["export"].get("claimName", ""):
        out.append(("spec.drafter.export.claimName", spec["drafter"]["export"].get("claimName", "")))
    out += [(field, claim) for _, field, claim in input_claims(spec)]
    return out


def input_claims(spec: Obj) -> list[tuple[str, str, str]]:
    """(volume name, field path, PVC name) of the read-only inputs mounted under SPECTRAIN_DATA_ROOT:
    the data source's claim ("data") and the model path's ("model", unless it is the same claim)."""
    out: list[tuple[str, str, str]] = []
    data = volumes.claim_of(spec["target"]["data"]["source"])
    if data:
        out.append(("data", "spec.target.data.source", data))
    model = volumes.claim_of((spec["target"].get("model") or {}).get("path"))
    if model and model != data:
        out.append(("model", "spec.target.model.path", model))
    return out


def iter_errors(paths: Iterable[str | Path]) -> Iterable[tuple[str, str]]:
    """(location, error) for every document of every file; location is FILE or FILE#N."""
    for path in paths:
        try:
            docs = load_manifests(path)
        except (OSError, yaml.YAMLError) as exc:
            yield str(path), f"(file): cannot read: {str(exc).splitlines()[0]}"
            continue
        if not docs:
            yield str(path), "(file): no YAML document found"
        for idx, doc in enumerate(docs):
            where = str(path) if len(docs) == 1 else f"{path}#{idx}"
            for err in validate(doc):
                yield where, err
