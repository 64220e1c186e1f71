#!/usr/bin/env python3
"""Validate every YAML document under deploy/ offline, as CI does: `python deploy/validate.py`.

Core Kubernetes kinds (Deployment, Service, RBAC, ...) are checked with kubernetes-validate, which
bundles the Kubernetes OpenAPI schemas (no cluster, no network), in strict mode: an unknown or
misspelt field is an error. Each document is checked against every --kubernetes-version given
(default: 1.30 and 1.37, an old floor and the newest bundled schema).

Custom resources are not in those schemas. The only one here, KEDA's ScaledObject, is checked
against deploy/schemas/keda-scaledobject.schema.json (written from KEDA's documented spec) with
jsonschema. Any other kind without a schema is an error, not a silent pass.

Prints one line per document (OK or FAIL) and exits 0 when all pass, 1 when any fails, 2 when it
finds no document.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

DEPLOY_DIR = Path(__file__).resolve().parent
SCHEMA_DIR = DEPLOY_DIR / "schemas"
DEFAULT_K8S_VERSIONS = ("1.30", "1.37")
# (apiVersion, kind) of the custom resources used here -> their JSON schema under deploy/schemas/.
CRD_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject.schema.json"}


def yaml_files(paths: list[Path]) -> list[Path]:
    """The YAML files named, or found (recursively) under the directories named, sorted."""
    found: list[Path] = []
    for p in paths:
        if p.is_dir():
            found += [f for f in p.rglob("*") if f.suffix in (".yaml", ".yml") and f.is_file()]
        else:
            found.append(p)
    return sorted(set(found))


def documents(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based index, document) for each non-empty YAML document of a file."""
    with path.open(encoding="utf-8") as f:
        for i, doc in enumerate(yaml.safe_load_all(f), start=1):
            if doc is not None:
                yield i, doc


def _path(parts: Any) -> str:
    return ".".join(str(p) for p in parts) or "<root>"


def check_crd(doc: dict, schema_file: str) -> str | None:
    """None if the custom resource matches its JSON schema, else the first error."""
    schema = json.loads((SCHEMA_DIR / schema_file).read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if not errors:
        return None
    e = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{_path(e.absolute_path)}: {e.message}{more}"


def check_core(doc: dict, versions: list[str]) -> str | None:
    """None if the resource validates (strict) against every Kubernetes version, else the error."""
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            return f"kubernetes {e.version}: {_path(e.path)}: {e.message}"
        except kubernetes_validate.SchemaNotFoundError as e:
            return f"no schema for {e.api_version} {e.kind} (a custom resource? add it to CRD_SCHEMAS)"
    return None


def check_document(doc: Any, versions: list[str]) -> tuple[str, str | None]:
    """(a short description of the document, None or the error)."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return "?", "not a Kubernetes object (needs apiVersion and kind)"
    meta = doc.get("metadata") or {}
    name = f"{meta.get('namespace', '-')}/{meta.get('name', '?')}"
    what = f"{doc['apiVersion']} {doc['kind']} {name}"
    schema_file = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema_file is not None:
        return f"{what} [schemas/{schema_file}]", check_crd(doc, schema_file)
    return f"{what} [kubernetes {', '.join(versions)}, strict]", check_core(doc, versions)


def validate_paths(paths: list[Path], versions: list[str], out: Any = None) -> int:
    """Validate every document of every YAML file; print one line each; return the exit status."""
    out = sys.stdout if out is None else out
    files = yaml_files(paths)
    count, failed = 0, 0
    seen: dict[tuple[str, str, str], str] = {}
    for f in files:
        label = f.relative_to(DEPLOY_DIR) if f.is_relative_to(DEPLOY_DIR) else f
        try:
            docs = list(documents(f))
        except (OSError, yaml.YAMLError) as e:
            count, failed = count + 1, failed + 1
            print(f"FAIL {label}: cannot read YAML: {e}", file=out)
            continue
        for i, doc in docs:
            count += 1
            what, error = check_document(doc, versions)
            if error is None and isinstance(doc, dict):
                meta = doc.get("metadata") or {}
                key = (doc["kind"], str(meta.get("namespace", "")), str(meta.get("name", "")))
                if key in seen:
                    error = f"same kind, namespace and name as {seen[key]}"
                seen[key] = f"{label}#{i}"
            if error is None:
                print(f"OK   {label}#{i} {what}", file=out)
            else:
                failed += 1
                print(f"FAIL {label}#{i} {what}: {error}", file=out)
    if count == 0:
        print(f"FAIL no YAML document found under {', '.join(map(str, paths))}", file=out)
        return 2
    print(f"{count - failed} of {count} documents valid", file=out)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[DEPLOY_DIR],
                        help="YAML files or directories (default: deploy/)")
    parser.add_argument("-k", "--kubernetes-version", action="append", dest="versions",
                        help=f"Kubernetes version(s) to validate against (default: {DEFAULT_K8S_VERSIONS})")
    args = parser.parse_args(argv)
    return validate_paths([p.resolve() for p in args.paths], args.versions or list(DEFAULT_K8S_VERSIONS))


if __name__ == "__main__":
    sys.exit(main())
